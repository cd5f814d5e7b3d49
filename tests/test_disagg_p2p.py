"""The KV transfer point to point (`tandem.engine.kv_p2p`): a prefill server sends the KV over a two-rank group of
its own with the decode server (gloo between CPU processes; NCCL between two GPUs, which needs two). Real servers
over HTTP; the prefill server a process of its own where it matters."""

import contextlib
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch
from test_disagg_transfer import REPO, SAMPLING, config, decode_server, generate, held, prompt, tokens

from tandem.engine import kv_p2p
from tandem.engine.engine import Engine
from tandem.server import disagg
from tandem.server.http import ServerThread

SERVE_PREFILL = """
import os, sys, torch
from tandem.config import EngineConfig
from tandem.engine import kv_p2p
from tandem.engine.engine import Engine
from tandem.server.http import ServerThread
device, threads, die = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "die"
torch.set_num_threads(threads)
if die:  # killed as it is asked to send: the decode server is receiving by then
    kv_p2p.P2PLink.send = lambda self, tensor: os._exit(9)
config = EngineConfig(page_size=4, num_pages=96, role="prefill", device=device)
with Engine("tiny", config) as engine, ServerThread(engine) as server:
    print(server.url, flush=True)
    sys.stdin.read()  # until the test closes it
"""


@contextlib.contextmanager
def prefill_process(device: str, die: bool = False):
    """A prefill server in a process of its own; `die`: one that exits when asked to send KV."""
    args = [sys.executable, "-c", SERVE_PREFILL, device, str(torch.get_num_threads()), "die" if die else "live"]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    with subprocess.Popen(args, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) as proc:
        try:
            url = proc.stdout.readline().strip()
            assert url.startswith("http://"), f"the prefill server did not start (exit code {proc.poll()})"
            yield url
        finally:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
            proc.wait(timeout=60)


def run_turns(p_url: str, d_url: str) -> list[tuple]:
    """Two prompts, the first again with a turn more (only its new pages move), then a page-aligned prompt the
    decode server holds whole (nothing moves): their tokens; no export held after any answer."""
    first = generate(d_url, p_url, prompt(30, seed=1))
    answers = [first, generate(d_url, p_url, prompt(24, seed=3))]
    answers.append(generate(d_url, p_url, prompt(30, seed=1) + first["output_ids"] + prompt(5, seed=10)))
    answers.append(generate(d_url, p_url, prompt(24, seed=3)))
    assert held(p_url) == 0
    return [tokens(a) for a in answers]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_point_to_point_the_servers_generate_what_bytes_do(device):
    """A prefill server in a process of its own (on a GPU: GPU 0, the decode server GPU 1), two decode servers
    one after the other: point to point gives exactly the tokens, logprobs and versions that bytes give, and only
    the pages the decode server lacks move."""
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL point to point needs two GPUs (it cannot put two ranks on one)")
    with prefill_process("cuda:0" if device == "cuda" else "cpu") as p_url:
        with decode_server("cuda:1" if device == "cuda" else "cpu", "bytes") as d_url:
            want = run_turns(p_url, d_url)
        assert httpx.post(f"{p_url}/flush_cache", json={}).status_code == 200  # (as it was: the same numerics)
        with decode_server("cuda:1" if device == "cuda" else "cpu", "p2p") as d_url:
            assert run_turns(p_url, d_url) == want
            records = httpx.get(f"{d_url}/pd/transfers").json()
    assert [r["transfer"] for r in records] == ["p2p"] * 4
    # the second turn from the 9 pages the decode server holds of its first (30 + 8 tokens, the last without KV)
    assert [r["start"] for r in records] == [0, 0, 36, 24] and records[3]["pages"] == 0, records


def test_a_prefill_server_killed_mid_transfer_ends_the_request_with_an_abort(monkeypatch):
    """The prefill server exits as the decode server receives its KV: the request ends with an abort naming the
    prefill server within the link's timeout, nothing written; the decode server then pairs with a live one."""
    monkeypatch.setattr(kv_p2p, "P2P_TIMEOUT_S", 8.0)
    monkeypatch.setattr(disagg, "P2P_TIMEOUT_S", 8.0)
    with decode_server("cpu", "p2p") as d_url:
        free = httpx.get(f"{d_url}/engine_stats").json()["pages_free"]
        with prefill_process("cpu", die=True) as p_url:
            body = {"input_ids": prompt(18), "sampling_params": SAMPLING, "bootstrap": {"prefill_url": p_url}}
            t0 = time.monotonic()
            r = httpx.post(f"{d_url}/generate", json=body, timeout=60)
            took = time.monotonic() - t0
        finish = r.json()["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and p_url in finish["message"], finish
        assert took < 8.0 + 2.0, took  # (the link's timeout, and the margin of a loaded machine)
        assert httpx.get(f"{d_url}/engine_stats").json()["pages_free"] == free
        with prefill_process("cpu") as p_url:
            assert generate(d_url, p_url, prompt(18))["meta_info"]["finish_reason"]["type"] == "length"


def test_received_kv_that_differs_is_named_by_page_and_nothing_is_written(monkeypatch):
    """The received buffer altered at position 9 (page 2) after the receive: the request ends with an abort naming
    the page, the export is gone from the prefill server, and the decode server's pages are as they were. (Both
    servers in this process: gloo pairs two groups of one process as it pairs two processes.)"""
    receive = kv_p2p.P2PLink.recv

    def altered(self, kv_2LTKD):
        receive(self, kv_2LTKD)
        kv_2LTKD[0, 1, 9, 0, 3] += 1.0

    monkeypatch.setattr(kv_p2p.P2PLink, "recv", altered)
    with Engine("tiny", config("cpu", "prefill")) as engine, ServerThread(engine) as prefill, \
            decode_server("cpu", "p2p") as d_url:
        free = httpx.get(f"{d_url}/engine_stats").json()["pages_free"]
        finish = generate(d_url, prefill.url, prompt(18))["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and "page 2 (positions 8...)" in finish["message"], finish
        assert held(prefill.url) == 0
        assert httpx.get(f"{d_url}/engine_stats").json()["pages_free"] == free


def test_point_to_point_is_chosen_only_where_it_can_be_made():
    """Across GPUs it can (and on CPUs); not between a CPU and a GPU, nor two servers on one GPU (NCCL), and a
    decode server told to take KV point to point says why it cannot."""
    here = disagg.sharing_domain("cpu")
    assert kv_p2p.why_not_p2p(here, "cpu") is None
    assert "on a cuda device, this server's on a cpu device" in kv_p2p.why_not_p2p(here | {"device": "cuda"}, "cpu")
    with Engine("tiny", config("cpu", "decode")) as d:
        client = disagg.PrefillClient(d, transfer="p2p")
        with pytest.raises(ValueError, match="takes KV by p2p, and cannot from u: its KV is on a cuda device"):
            client._choose("u", {"kinds": ["bytes", "reference", "p2p"], "sharing": here | {"device": "cuda"}})
        assert disagg.PrefillClient(d)._choose("u", {"kinds": ["bytes", "p2p"], "sharing": here}) == "p2p"
        assert disagg.PrefillClient(d)._choose("u", {"kinds": ["bytes", "reference", "p2p"],
                                                     "sharing": here}) == "reference"
    if torch.cuda.is_available():
        gpu = disagg.sharing_domain("cuda")
        assert "shares this server's GPU" in kv_p2p.why_not_p2p(gpu, "cuda")
