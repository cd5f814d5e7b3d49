"""Doorbells (`tandem.engine.doorbell`): the ringing side writes only a doorbells file's word with its ticket and
names what is wrong with a bad bell; on a GPU a queued wait holds its stream until the bell rings (from this process
or another), and a decode server whose passes wait on doorbells (`engine.kv_doorbells`) generates what bytes give,
each transfer queued before its KV was complete and run as the prefill engine rang (or, where it cannot ring, as
the ready mail lands). In process: an armed pass runs only once its bell rings, and a pause or an abort leaves none
queued (falsifier: an engine that does not disarm leaves it queued after acknowledging); on the CPU, with a stand-in
bell, whatever drops an armed reservation rings and drains it first, and a decode server asked for doorbells where
there are none takes the mail's way."""

import subprocess
import sys
import threading
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


def test_a_prefill_server_rings_its_bell_with_its_ready_mail_and_mails_where_it_cannot_ring():
    import asyncio
    from types import SimpleNamespace

    from tandem.server.disagg_mailbox import Mailbox, MailSender

    path, words = bells_file()

    async def go():
        box, sender = Mailbox(), MailSender()
        await box.start()
        try:
            seen = []
            for key, spec in (("k1", f"{path}:9:41"), ("k2", f"{path}:0:41")):  # (word 0 is no bell)
                kv = SimpleNamespace(pool_id="pool", start=0, end=9, page_size=4, pinned_at=0.0, read_s=0.0,
                                     routing=None, ready_at=1.5, wait_recorded=lambda: None, pages=[7, 3, 5],
                                     epochs=[1, 2, 9])
                ready = box.expect(key, "ready")
                sender.expect(key, key, box.name, spec)
                sender.pinned(key, kv, 4)
                sender.ready(key, kv)
                head, _ = await asyncio.wait_for(ready, 5)
                seen.append((head["rung"], int(words[9])))
            return seen
        finally:
            sender.close()
            await box.close()
    assert asyncio.run(go()) == [(True, 41), (False, 41)]


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


def test_a_bell_still_lent_past_its_deadline_is_rung_by_the_watchdog_and_no_other(monkeypatch):
    monkeypatch.setattr(doorbell.Doorbells, "_new_stream", lambda self: None)
    path, raw = _shared_memory(4 * doorbell.SLOTS, "test")
    bells = doorbell.Doorbells(path, raw, 0, None, torch.device("cpu"), None)
    late, back, free = bells.take(deadline_s=0.2), bells.take(deadline_s=0.2), bells.take()
    back.give_back()
    time.sleep(1.0)  # (the watchdog looks every 0.5 s)
    assert (late.word[0], back.word[0], free.word[0]) == (late.ticket, 0, 0)


@pytest.mark.gpu
@GPU
def test_a_host_call_held_by_a_queued_wait_is_let_go_by_the_bells_deadline():
    """A kernel first loaded (here a jiterated one) while a wait is queued waits for the device until the bell
    rings: the watchdog rings it at its deadline."""
    bell = doorbell.Doorbells.open(torch.device("cuda", 0)).take(deadline_s=1.0)
    bell.wait()
    start = time.monotonic()
    torch.special.bessel_j0(torch.ones(8, device="cuda")).cpu()
    held = time.monotonic() - start
    bell.stream.synchronize()
    bell.give_back()
    assert 0.8 < held < 10, held


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
    from test_disagg_transfer import bytes_then_reference

    want, got, records = bytes_then_reference(monkeypatch, 3, kv_doorbells=True)
    assert got == [want] * 3 and all(r["landed"] and r["armed"] and r["rung"] for r in records), records
    # a bell the prefill server cannot ring: the decode server rings it as the ready mail lands
    monkeypatch.setattr(doorbell.Bell, "spec", property(lambda bell: f"/proc/self/fd/999999:{bell.slot}:1"))
    want, got, records = bytes_then_reference(monkeypatch, 1, kv_doorbells=True)
    assert got == [want] and all(r["landed"] and r["armed"] and not r["rung"] for r in records), records
    # without doorbells: the mail's way, the pass launched as the ready mail lands
    want, got, records = bytes_then_reference(monkeypatch, 1, kv_doorbells=False)
    assert got == [want] and all(r["landed"] and not r["armed"] for r in records), records


def armed_then(monkeypatch, then: str, disarm: bool = True) -> dict:
    """A decode engine in this process on a GPU, a prefill server in another: the pass of an export by reference
    armed behind a doorbell, then `then` ("ring": the prefill side rings and the decode server takes the pass;
    "pause"; "abort"): what was seen. `disarm=False`: a mutant engine that leaves an armed pass queued when its
    reservation is dropped or it pauses."""
    import asyncio
    import json

    import test_disagg_transfer as t

    from tandem.engine.core_imports import DecodeImports
    from tandem.engine.engine import Engine
    from tandem.engine.kv_mapped import MappedKV, MappedPool
    from tandem.engine.kv_transfer import TransferClock
    from tandem.server.disagg_prefill import HEADER
    from tandem.types import SamplingParams

    if not disarm:
        monkeypatch.setattr(DecodeImports, "_disarm", lambda self, res: None)
    seen, ids, sampling = {}, t.prompt(70, seed=5), SamplingParams(**t.SAMPLING)

    async def go(p_url):
        body = {"rid": "r", "input_ids": ids, "sampling_params": t.SAMPLING, "kv_from": 0, "transfer": "reference"}
        r = t.httpx.post(f"{p_url}/pd/prefill", json=body, timeout=60)
        answer, (token, logprob, version) = r.json(), json.loads(r.headers[HEADER])["first"]
        with Engine("tiny", t.config("cuda", "decode")) as d, Engine("tiny", t.config("cuda", "decode")) as plain:
            source = MappedPool(t.httpx.get(f"{p_url}/pd/pool").json(), d.pool.k_cache.device)

            def mapped():
                return MappedKV(source, answer["kv"], "prefill", answer["id"]).with_clock(TransferClock("cuda"))
            want = await plain.generate_imported(ids, sampling, ([token], [logprob], [version]), mapped())
            bells = doorbell.Doorbells.open(torch.device("cuda", 0))
            free_bells = len(bells._free)
            assert await d.probe(ids, "r", reserve=True) == 0
            kv, before, bell = mapped(), d.pool.k_cache.cpu(), bells.take()
            # (a watchdog: a host call that waits for the device while the pass is queued behind the bell would
            # wait for ever; it fails the test instead)
            watchdog = threading.Timer(30, lambda: seen.setdefault("watchdog rang", True) and bell.ring())
            watchdog.start()
            assert d.arm_reserved("r", kv, version, bell)
            probe = torch.cuda.Event()
            probe.record(bell.stream)
            time.sleep(0.05)  # (the pool read as a copy, no kernel: nothing loaded while the pass waits)
            seen["ran_before_ring"] = probe.query() or not torch.equal(d.pool.k_cache.cpu(), before)
            if then == "ring":
                bell.ring()
                seen["landed"] = d.write_reserved("r", kv, version) and kv.check() is None
            elif then == "pause":
                await d.pause("in_place")
                seen["queued_after_ack"] = not probe.query()
                seen["landed"] = d.write_reserved("r", kv, version)
                await d.resume()
            else:
                d.abort("r")
                await d.get_stats()
                seen["queued_after_ack"] = not probe.query()
                seen["free"] = (await d.get_stats()).pages_free == t.POOL.num_pages
            bell.ring()  # (a mutant's pass left queued: let it go)
            bell.stream.synchronize()
            if then != "abort":
                out = await d.generate_imported(ids, sampling, ([token], [logprob], [version]), kv, "r")
                seen["same"] = (out.output_ids, out.output_logprobs) == (want.output_ids, want.output_logprobs)
            seen["bells_back"] = len(bells._free) == free_bells
            watchdog.cancel()
    with t.prefill_server("cuda") as p_url:
        asyncio.run(go(p_url))
    return seen


@pytest.mark.gpu
@GPU
def test_an_armed_pass_runs_only_as_its_bell_rings_and_decodes_what_one_engine_does(monkeypatch):
    assert armed_then(monkeypatch, "ring") == {"ran_before_ring": False, "landed": True, "same": True,
                                               "bells_back": True}


@pytest.mark.gpu
@GPU
def test_a_pause_or_an_abort_leaves_no_armed_pass_queued(monkeypatch):
    assert armed_then(monkeypatch, "pause") == {"ran_before_ring": False, "queued_after_ack": False,
                                                "landed": False, "same": True, "bells_back": True}
    assert armed_then(monkeypatch, "abort") == {"ran_before_ring": False, "queued_after_ack": False, "free": True,
                                                "bells_back": True}


@pytest.mark.gpu
@GPU
def test_the_disarm_falsifier_a_pause_or_an_abort_leaves_the_armed_pass_queued(monkeypatch):
    assert armed_then(monkeypatch, "pause", disarm=False)["queued_after_ack"]
    assert armed_then(monkeypatch, "abort", disarm=False)["queued_after_ack"]


class FakeBell:
    """(CPU: the lifecycle alone) a bell whose stream is the host."""

    def __init__(self):
        self.events = []
        self.stream = self

    def ring(self):
        self.events.append("rung")

    def synchronize(self):
        self.events.append("drained")

    def give_back(self):
        self.events.append("back")


def armed_reservation_dropped_by(monkeypatch, how: str, disarm: bool = True) -> list[str]:
    """A decode engine on the CPU holding a reservation with a pass armed behind a (fake) bell, dropped by `how`
    ("abort", "pause", "probe again", "stop"): what the bell saw. `disarm=False`: a mutant engine that leaves it."""
    import asyncio

    from test_disagg_mapped import POOL, prompt

    from tandem.engine.core_imports import Armed, DecodeImports
    from tandem.engine.engine import Engine

    if not disarm:
        monkeypatch.setattr(DecodeImports, "_disarm", lambda self, res: None)
    bell, kv = FakeBell(), type("Passed", (), {"finish_pass": lambda self: bell.events.append("taken")})()

    async def go():
        ids = prompt(22)
        with Engine("tiny", POOL) as d:
            await d.probe(ids, "r", reserve=True)
            d.core._reserved["r"].armed = Armed(kv, bell)
            if how == "abort":
                d.abort("r")
                await d.get_stats()
            elif how == "pause":
                await d.pause("in_place")
            elif how == "probe again":
                await d.probe(ids, "r", reserve=True)
                d.abort("r")
            # ("stop": leaving the `with` stops the engine)
    asyncio.run(go())
    return bell.events


@pytest.mark.parametrize("how", ["abort", "pause", "probe again", "stop"])
def test_whatever_drops_an_armed_reservation_rings_its_bell_and_drains_it_first(monkeypatch, how):
    assert armed_reservation_dropped_by(monkeypatch, how) == ["rung", "drained", "back", "taken"]


def test_the_disarm_falsifier_an_engine_that_does_not_disarm_leaves_the_bell_unrung(monkeypatch):
    assert armed_reservation_dropped_by(monkeypatch, "abort", disarm=False) == []


def test_a_decode_server_asked_for_doorbells_where_there_are_none_takes_the_mails_way(monkeypatch):
    """On the CPU (`Doorbells.open` gives None): the flag changes nothing; every transfer by mail, none armed."""
    from test_disagg_transfer import bytes_then_reference

    want, got, records = bytes_then_reference(monkeypatch, 1, "cpu", kv_doorbells=True)
    assert got == [want] and records and not any(r["armed"] for r in records), records
