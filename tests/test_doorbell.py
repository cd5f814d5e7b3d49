"""Doorbells (`tandem.engine.doorbell`): the ringing side writes only a doorbells file's word with its ticket and
names what is wrong with a bad bell; on a GPU a queued wait holds its stream until the bell rings (from this process
or another), and a decode server whose passes wait on doorbells (`engine.kv_doorbells`) generates what bytes give,
each transfer queued before its KV was complete and run as the prefill engine rang."""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.engine import doorbell
from tandem.engine.kv_pool import _shared_memory

REPO = Path(__file__).resolve().parents[1]
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def bells_file(magic: bool = True) -> tuple[str, np.ndarray]:
    path, raw = _shared_memory(4 * doorbell.SLOTS, "test")
    words = raw.numpy().view(np.uint32)
    if magic:
        words[0] = doorbell.MAGIC
    return path, words


def test_a_ring_writes_its_ticket_into_its_word_alone():
    path, words = bells_file()
    doorbell.ring(f"{path}:5:77")
    assert words[5] == 77 and words[1:].sum() == 77


@pytest.mark.parametrize("spec, why", [
    ("nonsense", "not FILE:WORD:TICKET"), ("/proc/1/fd/1:x:3", "not FILE:WORD:TICKET"),
    ("{path}:0:3", "out of range"), ("{path}:1024:3", "out of range"), ("{path}:3:0", "out of range"),
    ("/proc/self/fd/999999:3:3", "doorbell"),
])
def test_a_bad_bell_is_refused_naming_what_is_wrong(spec, why):
    path, words = bells_file()
    with pytest.raises(ValueError, match=why):
        doorbell.ring(spec.format(path=path))
    assert words[1:].sum() == 0


def test_the_magic_falsifier_a_file_that_is_no_doorbells_file_is_not_written():
    path, words = bells_file(magic=False)
    with pytest.raises(ValueError, match="no doorbells file"):
        doorbell.ring(f"{path}:5:77")
    assert words.sum() == 0


def test_no_doorbells_off_a_gpu():
    assert doorbell.Doorbells.open(torch.device("cpu")) is None


def held_until_rung(bells: doorbell.Doorbells, ring) -> tuple[float, float]:
    """A wait queued on a bell's stream, then a write behind it: (whether the stream was past it 50 ms later, what
    the tensor holds after the ring and the stream's end)."""
    bell = bells.take()
    x = torch.zeros(1, device=bells.device)
    with torch.cuda.stream(bell.stream):
        bell.wait()
        x.fill_(1)
    probe = torch.cuda.Event()
    probe.record(bell.stream)
    time.sleep(0.05)
    before = float(probe.query())  # (the host reads nothing of x yet: its write is held)
    ring(bell)
    bell.stream.synchronize()
    bell.give_back()
    return before, x.item()


@pytest.mark.gpu
@GPU
def test_a_wait_holds_its_stream_until_the_bell_rings_here_or_in_another_process():
    bells = doorbell.Doorbells.open(torch.device("cuda", 0))
    assert bells is not None
    assert held_until_rung(bells, lambda bell: bell.ring()) == (0.0, 1.0)
    code = "import sys; from tandem.engine.doorbell import ring; ring(sys.argv[1])"
    assert held_until_rung(bells, lambda bell: subprocess.run([sys.executable, "-c", code, bell.spec], cwd=REPO,
                                                              check=True)) == (0.0, 1.0)


@pytest.mark.gpu
@GPU
def test_a_decode_server_whose_passes_wait_on_doorbells_generates_what_bytes_give(monkeypatch):
    import dataclasses

    import test_disagg_transfer as t

    ids = t.prompt(70, seed=5)
    with t.prefill_server("cuda") as p_url, t.decode_server("cuda", "bytes") as d_url:
        want = t.tokens(t.generate(d_url, p_url, ids))
    monkeypatch.setattr(t, "POOL", dataclasses.replace(t.POOL, kv_doorbells=True))
    with t.prefill_server("cuda") as p_url, t.decode_server("cuda", "reference") as d_url:
        got = [t.tokens(t.generate(d_url, p_url, ids)) for _ in range(3)]
        records = t.httpx.get(f"{d_url}/pd/transfers").json()
    assert got == [want] * 3 and all(r["landed"] and r["armed"] for r in records), records
