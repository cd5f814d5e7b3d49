"""The two KV transfers between a prefill server and a decode server (`tandem.server.disagg`): bytes in the answer's
body, or by reference (the prefill server's pool mapped once by the decode server: a shared-memory file on a CPU,
CUDA IPC on a GPU; its pages pinned by the prefill server until the decode server releases them or a timeout
passes). Real servers over HTTP, on CPU (fp32) and, where there is one, on a
GPU, whose prefill server runs in a process of its own (CUDA IPC cannot map a process's own memory)."""

import asyncio
import contextlib
import dataclasses
import functools
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import httpx
import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine import kv_transfer
from tandem.engine.engine import Engine
from tandem.engine.kv_transfer import KVPages, why_not_shared
from tandem.server import disagg, disagg_prefill
from tandem.server.http import ServerThread
from tandem.types import SamplingParams

POOL = EngineConfig(page_size=4, num_pages=96)
SAMPLING = {"max_new_tokens": 8, "temperature": 0.7, "seed": 11, "ignore_eos": True}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
REPO = Path(__file__).resolve().parents[1]

SERVE_PREFILL = """
import sys, torch
from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.server import disagg_prefill
from tandem.server.http import ServerThread
device, release_timeout_s, threads = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
disagg_prefill.RELEASE_TIMEOUT_S = release_timeout_s
config = EngineConfig(page_size=4, num_pages=96, role="prefill", device=device)
with Engine("tiny", config) as engine, ServerThread(engine) as server:
    print(server.url, flush=True)
    sys.stdin.read()  # until the test closes it
"""


def config(device: str, role: str = "unified") -> EngineConfig:
    return dataclasses.replace(POOL, device=device, role=role)


def prompt(n, seed=0):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@contextlib.contextmanager
def prefill_server(device: str, release_timeout_s: float = 60.0, own_process: bool | None = None):
    """A prefill server's URL: served from this process, or (by default on a GPU) from a process of its own."""
    if not (device == "cuda" if own_process is None else own_process):
        with mock.patch.object(disagg_prefill, "RELEASE_TIMEOUT_S", release_timeout_s), \
                Engine("tiny", config(device, "prefill")) as engine, ServerThread(engine) as server:
            yield server.url
        return
    args = [sys.executable, "-c", SERVE_PREFILL, device, str(release_timeout_s), str(torch.get_num_threads())]
    with subprocess.Popen(args, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        try:
            url = proc.stdout.readline().strip()
            assert url.startswith("http://"), f"the prefill server did not start (exit code {proc.poll()})"
            yield url
        finally:
            proc.stdin.close()
            proc.wait(timeout=60)


async def chosen_transfer(engine: Engine, url: str, transfer: str | None) -> str:
    """The transfer a decode server of `engine` chooses (or is refused, raising) when it pairs with the prefill
    server at `url`, asked for `transfer` (None: its choice)."""
    client = disagg.PrefillClient(engine, transfer=transfer)
    try:
        await client.pair(url)
        return client.paired[url]
    finally:
        await client.close()


@contextlib.contextmanager
def decode_server(device: str, transfer: str | None):
    """A decode server whose `PrefillClient` takes KV by `transfer` (None: its own choice)."""
    client = functools.partial(disagg.PrefillClient, transfer=transfer)
    with mock.patch.object(disagg, "PrefillClient", client), Engine("tiny", config(device, "decode")) as engine, \
            ServerThread(engine) as server:
        yield server.url


def generate(decode_url: str, prefill_url: str, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": SAMPLING, "return_logprob": True,
            "bootstrap": {"prefill_url": prefill_url}}
    r = httpx.post(f"{decode_url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def tokens(answer: dict) -> tuple:
    meta = answer["meta_info"]
    return (answer["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]],
            meta["output_token_weight_versions"], meta["finish_reason"]["type"])


def held(prefill_url: str) -> int:
    return httpx.get(f"{prefill_url}/pd/info", timeout=10).json()["transfer"]["held"]


def export(prefill_url: str, ids: list[int]) -> dict:
    """A prefill server's answer to a reference transfer of `ids`, taken by nobody: {"id": ..., "kv": handle}."""
    body = {"rid": "r", "input_ids": ids, "sampling_params": SAMPLING, "kv_from": 0, "transfer": "reference"}
    r = httpx.post(f"{prefill_url}/pd/prefill", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    return r.json()


def bytes_then_reference(monkeypatch, times: int, device: str = "cuda",
                         **options) -> tuple[tuple, list[tuple], list[dict]]:
    """A prompt through a decode server taking its KV as bytes, then `times` through one taking it by reference with
    the engine `options` (`EngineConfig` fields) on: (the bytes way's tokens, the reference way's, the decode
    server's transfer records)."""
    ids = prompt(70, seed=5)
    with prefill_server(device) as p_url, decode_server(device, "bytes") as d_url:
        want = tokens(generate(d_url, p_url, ids))
    monkeypatch.setattr(sys.modules[__name__], "POOL", dataclasses.replace(POOL, **options))
    with prefill_server(device) as p_url, decode_server(device, "reference") as d_url:
        got = [tokens(generate(d_url, p_url, ids)) for _ in range(times)]
        return want, got, httpx.get(f"{d_url}/pd/transfers").json()


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("device,own_process", [("cpu", False), ("cpu", True), pytest.param(
    "cuda", True, marks=pytest.mark.gpu)], ids=["cpu", "cpu, prefill server in a process of its own", "cuda"])
def test_by_reference_the_servers_generate_what_bytes_and_one_engine_do(device, own_process):
    """Prompts one after another, then each again with a turn more, then a page-aligned prompt the decode server
    holds every page of (nothing to send): by reference exactly the tokens, logprobs and versions that bytes give,
    the first turns exactly one engine's; the prefill server holds no export after any answer."""
    prompts = [prompt(30, seed=1), prompt(17, seed=2), prompt(24, seed=3)]
    with Engine("tiny", config(device)) as unified:
        want = [tokens_of(asyncio.run(unified.generate(ids, SamplingParams(**SAMPLING)))) for ids in prompts]
    got = {}
    for transfer in ("bytes", "reference"):
        answers = []
        with prefill_server(device, own_process=own_process) as p_url, decode_server(device, transfer) as d_url:
            for ids in prompts:
                answers.append(generate(d_url, p_url, ids))
                assert held(p_url) == 0
            for i, ids in enumerate(prompts):
                answers.append(generate(d_url, p_url, ids + answers[i]["output_ids"] + prompt(5, seed=10 + i)))
                assert held(p_url) == 0
            answers.append(generate(d_url, p_url, prompts[2]))
            assert held(p_url) == 0
            records = httpx.get(f"{d_url}/pd/transfers").json()
            assert [r["transfer"] for r in records] == [transfer] * 7
            # only the pages the decode server lacks: a later turn from its cached history, then nothing
            assert [r["start"] for r in records[:3]] == [0, 0, 0]
            assert all(r["start"] >= len(ids) // 4 * 4 for r, ids in zip(records[3:6], prompts, strict=True))
            assert records[6]["start"] == records[6]["end"] == 24 and records[6]["pages"] == 0
            for r in records:  # the transfer timed by itself, inside the end-to-end time
                per_token = 2 * 2 * 2 * 32 * 4  # (tiny: keys and values, 2 layers, 2 KV heads, head dim 32, fp32)
                assert r["pages"] == -(-(r["end"] - r["start"]) // 4), r
                assert r["kv_bytes"] == (r["end"] - r["start"]) * per_token, r
                assert r["export_s"] > 0 and 0 < r["take_s"] <= r["import_s"] and r["write_s"] >= 0, r
                # (armed behind a doorbell, the pass ran as it rang, before the ready mail began `import_s`)
                assert r["armed"] or r["write_s"] <= r["import_s"], r
                if transfer == "reference":  # written as the answer landed, then queued; timed on one clock too
                    assert r["landed"] and r["handoff_s"] >= 0 and r["path_s"] >= r["import_s"], r
        got[transfer] = [tokens(a) for a in answers]
    assert got["reference"] == got["bytes"]
    assert got["reference"][:3] == want


def tokens_of(out) -> tuple:
    return out.output_ids, out.output_logprobs, out.weight_versions, out.finish_reason.type


def pinned_free(prefill_url: str) -> int:
    """The prefill server's free pages once its prefix cache is flushed: what is not free is pinned by exports."""
    assert httpx.post(f"{prefill_url}/flush_cache", timeout=10).status_code == 200
    return httpx.get(f"{prefill_url}/engine_stats", timeout=10).json()["pages_free"]


def unreleased_export(device: str, monkeypatch, timeout_release: bool = True) -> tuple[int, int, int]:
    """A reference export nobody releases, with a 0.3 s timeout: the exports its prefill server holds just after it,
    and once 3 s have passed (or none is held); then the pages of its pool still pinned. `timeout_release=False`: a
    mutant prefill server whose timeout frees nothing."""
    if not timeout_release:
        monkeypatch.setattr(disagg.Exports, "_expire", lambda self, export_id: None)
    with prefill_server(device, release_timeout_s=0.3) as url:
        answer = export(url, prompt(18))
        assert 2 * len(answer["kv"]["pages"]) == len(answer["kv"]["epochs"]) == 80  # (5 pages: int32, int64 each)
        before = held(url)
        wait_until(lambda: held(url) == 0, timeout_s=3.0)
        return before, held(url), POOL.num_pages - pinned_free(url)


@pytest.mark.parametrize("device", DEVICES)
def test_an_export_nobody_releases_is_freed_after_the_timeout(device, monkeypatch):
    assert unreleased_export(device, monkeypatch) == (1, 0, 0)


def test_the_timeout_falsifier_without_it_an_unreleased_export_stays_held(monkeypatch):
    assert unreleased_export("cpu", monkeypatch, timeout_release=False) == (1, 1, 5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_reference_that_changed_is_named_by_page_and_still_released(device, monkeypatch):
    """The prefill server's pool altered at position 9 (page 2) after it answered, through the decode server's
    mapping (as memory reused under a transfer would be): the request ends with an abort naming the prefill server
    and the page, the export is released all the same (its pages unpinned), and the decode server's pages are as
    they were (the pages it wrote freed, nothing cached). (By the answer: test_disagg_mailbox has the mail's.)"""
    from disagg_helpers import no_mail

    no_mail(monkeypatch)
    take = disagg.PrefillClient._take

    async def altered(self, url, data, clock, meta):
        kv = await take(self, url, data, clock, meta)
        slot = int(kv.pages[2]) * kv.page_size + 1
        kv.source.k[1, slot, 0, 3] += 1.0
        if kv.source.k.is_cuda:
            torch.cuda.synchronize(kv.source.k.device)
        return kv

    monkeypatch.setattr(disagg.PrefillClient, "_take", altered)
    with prefill_server(device) as p_url, decode_server(device, "reference") as d_url:
        free = httpx.get(f"{d_url}/engine_stats").json()["pages_free"]
        finish = generate(d_url, p_url, prompt(18))["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and p_url in finish["message"], finish
        assert "page 2 (positions 8...)" in finish["message"], finish
        assert wait_until(lambda: held(p_url) == 0, timeout_s=5.0) and pinned_free(p_url) == POOL.num_pages
        assert httpx.get(f"{d_url}/engine_stats").json()["pages_free"] == free


def test_the_decode_server_takes_kv_by_reference_where_it_can_and_says_why_it_cannot(monkeypatch):
    """Paired with a prefill server of this host: by reference unless told bytes. A prefill server of another host
    (or on another kind of device, or on CUDA this very process) gives its KV point to point by default where it
    can (CPUs here), and a decode server told to take references refuses the request, naming why."""
    with prefill_server("cpu") as p_url, Engine("tiny", config("cpu", "decode")) as d:
        def chosen(transfer):
            return asyncio.run(chosen_transfer(d, p_url, transfer))

        assert chosen(None) == "reference" and chosen("bytes") == "bytes"
        here = kv_transfer.sharing_domain("cpu")
        assert why_not_shared(here, "cpu") is None
        assert "another host" in why_not_shared(here | {"host": "elsewhere/0"}, "cpu")
        assert "on a cuda device, this server's on a cpu device" in why_not_shared(here | {"device": "cuda"}, "cpu")
        assert "this very process" in why_not_shared(here | {"device": "cuda"}, "cuda")
        real = disagg.sharing_domain
        monkeypatch.setattr(disagg, "sharing_domain", lambda device: real(device) | {"host": "elsewhere/0"})
        assert chosen(None) == "p2p"  # (gloo between CPUs: see test_disagg_p2p)
        with pytest.raises(ValueError, match="takes KV by reference, and cannot from .*another host"):
            chosen("reference")
        with decode_server("cpu", "reference") as d_url:
            body = {"input_ids": prompt(9), "sampling_params": SAMPLING, "bootstrap": {"prefill_url": p_url}}
            r = httpx.post(f"{d_url}/generate", json=body, timeout=60)
            assert r.status_code == 400 and "another host" in r.text, r.text


@pytest.mark.parametrize("device", DEVICES)
def test_an_export_is_a_copy_on_the_pools_device_that_outlives_its_pages(device):
    """A prefill engine's export by copy (bytes, point to point) is its own memory on the pool's device: the pool's
    pages rewritten after it, it still verifies, as bytes too."""
    async def go():
        with Engine("tiny", config(device, "prefill")) as p:
            first = await p.generate(prompt(18), dataclasses.replace(SamplingParams(**SAMPLING), max_new_tokens=1),
                                     export_kv_from=0)
            kv = first.kv
            assert kv.k.device == p.pool.k_cache.device
            p.pool.k_cache.fill_(7.0)  # (the engine is idle: its pages are the export's no more)
            p.pool.v_cache.fill_(7.0)
            kv.verify()
            data = kv.to_bytes()
            KVPages.from_bytes(data, kv_transfer.wire_meta(data)).verify()
    asyncio.run(go())


def test_a_pool_that_cannot_be_mapped_falls_back_to_bytes_unless_reference_was_asked_for(monkeypatch):
    def unmappable(handle, device):
        raise ValueError("no mapping here")

    monkeypatch.setattr(disagg, "MappedPool", unmappable)
    with prefill_server("cpu") as p_url, Engine("tiny", config("cpu", "decode")) as d:
        assert asyncio.run(chosen_transfer(d, p_url, None)) == "bytes"
        with pytest.raises(ValueError, match="cannot be mapped.*no mapping here"):
            asyncio.run(chosen_transfer(d, p_url, "reference"))
