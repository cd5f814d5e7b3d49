"""The KV transfer by reference's side channel (`tandem.server.disagg_mailbox`): a pinned export's pages mailed by the
prefill engine as it pins them (as it launches the step that computes them), then its ready mail once the step's
result is in; written and checked by the decode server as the ready mail lands, before the pages are used; the HTTP
answer confirms it. Real servers over HTTP (CPU, fp32; the GPU case with the prefill server in a process of its
own). Falsifiers: a page changed after the prefill wrote it (the comparison), an answer naming other pages than the
mail (the confirmation), pages read as their pages mail lands (the ready mail; a GPU's late KV simulated)."""

import time

import httpx
import pytest
import torch
from disagg_helpers import no_mail, write_reserved_blind_to_pause
from test_disagg_transfer import (
    DEVICES,
    POOL,
    decode_server,
    generate,
    held,
    pinned_free,
    prefill_server,
    prompt,
    tokens,
    wait_until,
)

from tandem.server import disagg_import, disagg_prefill


def slow_answers(monkeypatch, seconds: float = 0.3) -> None:
    """The prefill server (of this process) answers `seconds` late: its mail surely comes first."""
    answer = disagg_prefill._reference_answer

    def slow(export_id, kv):
        time.sleep(seconds)
        return answer(export_id, kv)
    monkeypatch.setattr(disagg_prefill, "_reference_answer", slow)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_by_reference_comes_by_mail_and_generates_what_bytes_give(device):
    prompts = [prompt(30, seed=3), prompt(21, seed=4)]
    with prefill_server(device) as p_url, decode_server(device, "bytes") as d_url:
        want = [tokens(generate(d_url, p_url, ids)) for ids in prompts]
    with prefill_server(device) as p_url, decode_server(device, "reference") as d_url:
        got = [tokens(generate(d_url, p_url, ids)) for ids in prompts]
        records = httpx.get(f"{d_url}/pd/transfers").json()
        assert wait_until(lambda: held(p_url) == 0, timeout_s=5.0) and pinned_free(p_url) == POOL.num_pages
    assert got == want and len(records) == 2 and all(r["landed"] for r in records), records
    mailed = [r for r in records if r["mailed"]]  # (a mail later than its answer is not taken: rare, on a busy host)
    assert mailed and all(r["path_parts"]["mail_s"] >= 0 for r in mailed), records


def test_without_a_mailbox_kv_by_reference_takes_the_answers_way(monkeypatch):
    no_mail(monkeypatch)
    ids = prompt(30, seed=3)
    with prefill_server("cpu") as p_url, decode_server("cpu", "bytes") as d_url:
        want = tokens(generate(d_url, p_url, ids))
    with prefill_server("cpu") as p_url, decode_server("cpu", "reference") as d_url:
        assert tokens(generate(d_url, p_url, ids)) == want
        record = httpx.get(f"{d_url}/pd/transfers").json()[-1]
    assert record["landed"] and not record["mailed"] and record["path_parts"]["wire_s"] >= 0, record


def test_a_page_changed_after_the_prefill_wrote_it_ends_the_request_by_mail_too(monkeypatch):
    """The prefill server's pool altered at page 2 as the mail lands (its records unchanged): the decode server's
    comparison finds it, the request ends with an abort naming the page; the export is released, the
    decode server's pages freed."""
    slow_answers(monkeypatch)
    mapped = disagg_import.mapped_from_mail
    altered = []

    def altering(source, head, payload, origin):
        kv = mapped(source, head, payload, origin)
        source.k[1, int(kv.pages[2]) * kv.page_size + 1, 0, 3] += 1.0
        altered.append(kv)
        return kv
    monkeypatch.setattr(disagg_import, "mapped_from_mail", altering)
    with prefill_server("cpu") as p_url, decode_server("cpu", "reference") as d_url:
        free = httpx.get(f"{d_url}/engine_stats").json()["pages_free"]
        finish = generate(d_url, p_url, prompt(18))["meta_info"]["finish_reason"]
        assert altered and finish["type"] == "abort" and p_url in finish["message"], finish
        assert "page 2 (positions 8...)" in finish["message"], finish
        assert wait_until(lambda: held(p_url) == 0, timeout_s=5.0) and pinned_free(p_url) == POOL.num_pages
        assert httpx.get(f"{d_url}/engine_stats").json()["pages_free"] == free


def test_an_answer_naming_other_pages_than_its_mail_ends_the_request(monkeypatch):
    slow_answers(monkeypatch)
    answer = disagg_prefill._reference_answer

    def other(export_id, kv):
        kv.handle = kv.handle | {"pages": kv.handle["pages"][8:] + kv.handle["pages"][:8]}  # (first two swapped)
        return answer(export_id, kv)
    monkeypatch.setattr(disagg_prefill, "_reference_answer", other)
    with prefill_server("cpu") as p_url, decode_server("cpu", "reference") as d_url:
        free = httpx.get(f"{d_url}/engine_stats").json()["pages_free"]
        finish = generate(d_url, p_url, prompt(18))["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and "other KV than its mail" in finish["message"], finish
        assert wait_until(lambda: held(p_url) == 0, timeout_s=5.0) and pinned_free(p_url) == POOL.num_pages
        assert httpx.get(f"{d_url}/engine_stats").json()["pages_free"] == free


def mailed_while_paused(monkeypatch, check_pause: bool) -> tuple[bool, bool, bool]:
    """The decode server paused (in place, acknowledged) before a request by reference whose mail then lands, and
    continued 0.5 s later (its answers 0.3 s late): whether its generation ended before the continue, whether it came by
    mail, and whether it generated what bytes give. `check_pause=False`: a mutant `write_reserved` that does not see the
    pause."""
    import concurrent.futures

    if not check_pause:
        write_reserved_blind_to_pause(monkeypatch)
    ids = prompt(26, seed=7)
    slow_answers(monkeypatch)  # (the mail surely lands first: on a busy host it can come after the answer)
    with prefill_server("cpu") as p_url, decode_server("cpu", "bytes") as d_url:
        want = tokens(generate(d_url, p_url, ids))
    with prefill_server("cpu") as p_url, decode_server("cpu", "reference") as d_url, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert httpx.post(f"{d_url}/pause_generation", json={"mode": "in_place"}).status_code == 200
        answer = pool.submit(generate, d_url, p_url, ids)
        time.sleep(0.5)
        early = answer.done()
        assert httpx.post(f"{d_url}/continue_generation", json={}).status_code == 200
        got = tokens(answer.result(timeout=60))
        record = httpx.get(f"{d_url}/pd/transfers").json()[-1]
    return early, record["mailed"], got == want


def test_a_pause_acknowledged_before_the_mail_lands_holds_its_write_until_continue(monkeypatch):
    assert mailed_while_paused(monkeypatch, check_pause=True) == (False, False, True)


def test_the_mail_pause_falsifier_a_write_that_does_not_see_the_pause_writes_by_mail(monkeypatch):
    assert mailed_while_paused(monkeypatch, check_pause=False)[1]


def test_a_mailbox_hands_each_frame_to_its_waiter_drops_the_rest_and_a_bad_stream(monkeypatch):
    """`Mailbox` and `MailSender` alone: frames reach the future of their key and kind; a frame nobody waits for is
    dropped; a ready mail goes only for the export whose pages were mailed, and not once it was pinned again; a stream
    that does not parse is closed (the sender's next send fails and drops its connection: the answer's way then)."""
    import asyncio
    import json
    import socket
    import struct
    from types import SimpleNamespace

    from tandem.server.disagg_mailbox import Mailbox, MailSender, _address

    async def go():
        box, sender = Mailbox(), MailSender()
        await box.start()
        try:
            pages = box.expect("k1", "pages")
            sender.expect("engine-1", "k1", box.name)
            sender.expect("engine-2", "nobody", box.name)
            ready = box.expect("k1", "ready")

            def export():
                return SimpleNamespace(pool_id="pool", start=0, end=9, page_size=4, pinned_at=0.0, read_s=0.0,
                                       routing=None, ready_at=1.5, wait_recorded=lambda: None, pages=[7, 3, 5],
                                       epochs=[1, 2, 9])
            kv = export()
            sender.pinned("engine-2", kv, 0)  # (nobody waits: dropped)
            sender.pinned("engine-1", kv, 4)
            head, payload = await asyncio.wait_for(pages, 5)
            assert (head["rid"], head["version"], head["end"]) == ("k1", 4, 9)
            assert payload == struct.pack("<3i3q", 7, 3, 5, 1, 2, 9)
            sender.ready("engine-1", export())  # (not the export mailed: nothing)
            await asyncio.sleep(0.1)
            assert not ready.done()
            sender.ready("engine-1", kv)
            head, payload = await asyncio.wait_for(ready, 5)
            assert (head["rid"], head["ready_at"], payload) == ("k1", 1.5, b"")
            sender.expect("engine-3", "k3", box.name)
            again = box.expect("k3", "ready")
            sender.pinned("engine-3", kv, 4)
            sender.pinned("engine-3", kv, 4)  # (pinned again, retracted and recomputed: the first pages are void)
            sender.ready("engine-3", kv)
            await asyncio.sleep(0.1)
            assert not again.done()
            again.cancel()
            bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            bad.connect(_address(box.name))
            bad.sendall(struct.pack("<II", 5, 0) + b"{oops")
            await asyncio.sleep(0.2)
            assert bad.recv(1) == b""  # (closed by the mailbox)
            bad.close()
            assert json.dumps(sorted(box._waiting)) == "[]"  # (the futures done, none left)
        finally:
            sender.close()
            await box.close()
    asyncio.run(go())


def test_a_mail_that_would_block_drops_its_connection_and_never_blocks():
    """The engine's thread sends the pages' mail: to a mailbox that stopped reading, a send that would block drops
    the connection (False: the answer's way) instead of waiting (falsifier: a blocking socket would hang here)."""
    import socket

    from tandem.server.disagg_mailbox import MailSender

    sender, (mine, theirs) = MailSender(), socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mine.settimeout(0.0)  # (as `_connect` leaves it)
    sender._sockets["box"] = mine
    began, sent = time.monotonic(), 0
    while sender._send("box", {"kind": "pages"}, b"x" * (1 << 20)):  # (nobody reads `theirs`)
        sent += 1
        assert sent < 64, "the buffer never filled"
    assert time.monotonic() - began < 1.0 and "box" not in sender._sockets and mine.fileno() == -1
    theirs.close()


def test_a_mailbox_takes_frames_however_their_bytes_arrive(caplog):
    """Frames cut anywhere (a byte a send) and several in one send each reach the request waiting for them; one
    nobody waits for is dropped; a frame that does not parse drops its connection alone (logged)."""
    import asyncio
    import json
    import socket

    from tandem.server.disagg_mailbox import _FRAME, Mailbox, _address

    def frame(head: dict, payload: bytes) -> bytes:
        data = json.dumps(head).encode()
        return _FRAME.pack(len(data), len(payload)) + data + payload

    async def go():
        box = Mailbox()
        await box.start()
        loop = asyncio.get_running_loop()
        a, b, c = (box.expect(k, kind) for k, kind in (("r1", "pages"), ("r1", "sums"), ("r2", "pages")))
        first = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        first.connect(_address(box.name))
        one = frame({"rid": "r1", "kind": "pages"}, b"\x01\x00\x00\x00")
        for i in range(len(one)):  # a byte a send
            first.send(one[i:i + 1])
            await asyncio.sleep(0)
        first.send(frame({"rid": "nobody", "kind": "pages"}, b"") + frame({"rid": "r1", "kind": "sums"}, b"x" * 16))
        got_a, got_b = await asyncio.wait_for(asyncio.gather(a, b), 5)
        bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bad.connect(_address(box.name))
        bad.send(_FRAME.pack(3, 0) + b"{x}")
        await loop.run_in_executor(None, bad.recv, 1)  # (returns once the mailbox closes the connection)
        first.send(frame({"rid": "r2", "kind": "pages"}, b"ok"))  # the other connection still delivers
        got_c = await asyncio.wait_for(c, 5)
        for s in (first, bad):
            s.close()
        await box.close()
        return got_a, got_b, got_c, box._waiting

    got_a, got_b, got_c, waiting = asyncio.run(go())
    assert got_a == ({"rid": "r1", "kind": "pages"}, b"\x01\x00\x00\x00") and got_b[1] == b"x" * 16
    assert got_c[1] == b"ok" and not waiting
    assert "a mailbox frame did not parse" in caplog.text


def test_a_frame_that_claims_more_than_a_mail_holds_closes_its_connection(caplog):
    """A frame's length is read before its bytes: one claiming more than `MAX_FRAME_BYTES` closes the connection
    at once, rather than the mailbox buffering up to a gigabyte of a broken or hostile stream."""
    import asyncio
    import socket

    from tandem.server.disagg_mailbox import _FRAME, MAX_FRAME_BYTES, Mailbox, _address

    async def go():
        box = Mailbox()
        await box.start()
        bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bad.connect(_address(box.name))
        bad.settimeout(5)  # (a mailbox that keeps it open fails the test in 5 s)
        bad.send(_FRAME.pack(16, MAX_FRAME_BYTES) + b"x" * 64)
        closed = await asyncio.get_running_loop().run_in_executor(None, bad.recv, 1)
        bad.close()
        await box.close()
        return closed

    assert asyncio.run(go()) == b"" and "a mailbox frame did not parse" in caplog.text


def test_a_frame_cut_short_by_its_connection_is_dropped_and_the_next_connection_delivers():
    """A prefill server that dies mid-frame leaves half a frame: it is dropped with its connection (each
    connection cuts its own frames), and the request's frame from a new connection still arrives whole."""
    import asyncio
    import json
    import socket

    from tandem.server.disagg_mailbox import _FRAME, Mailbox, _address

    async def go():
        box = Mailbox()
        await box.start()
        waiting = box.expect("r1", "pages")
        data = json.dumps({"rid": "r1", "kind": "pages"}).encode()
        frame = _FRAME.pack(len(data), 4) + data + b"\x01\x02\x03\x04"
        for cut in (frame[:-2], frame):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(_address(box.name))
            sock.sendall(cut)
            sock.close()
            await asyncio.sleep(0.1)
            if cut is not frame:
                assert not waiting.done()  # (half a frame delivers nothing)
        head, payload = await asyncio.wait_for(waiting, 5)
        await box.close()
        return head, payload, box._connections

    head, payload, connections = asyncio.run(go())
    assert head["rid"] == "r1" and payload == b"\x01\x02\x03\x04" and not connections


def records_queued_at_the_pin(monkeypatch, waited: bool) -> tuple[dict, int]:
    """A prefill server whose pinning queues checksum records as a GPU's would (pages loaded from the host tier, say:
    `KVPool.record_pages`), simulated on the CPU: the pinned pages' records hold other values until the records'
    event is waited for. A prompt through a decode server by reference: its finish reason, and the mails sent.
    `waited=False`: a mutant export that names its pages before its records are done."""
    from tandem.engine.kv_mapped import PinnedKV
    from tandem.engine.kv_pool import KVPool
    from tandem.server.disagg_mailbox import MailSender

    class Queued:  # (a CUDA event's part the export uses, behind records not yet written)
        def __init__(self, pool, slots):
            self.pool, self.slots, self.done = pool, slots, False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            if not self.done:
                self.pool.record_sums(self.slots)  # (the records as the kernel would have written them)
                self.done = True

    def queued(pool, pages):
        P = pool.page_size
        slots = torch.tensor([p * P + i for p in pages for i in range(P)])
        pool.sums[slots] += 1  # (what the records hold until then: another write's)
        return Queued(pool, slots)

    monkeypatch.setattr(KVPool, "record_pages", queued)
    if not waited:
        monkeypatch.setattr(PinnedKV, "is_recorded", lambda self: True)
        monkeypatch.setattr(PinnedKV, "wait_recorded", lambda self: None)
    sent = []
    send = MailSender._send
    monkeypatch.setattr(MailSender, "_send", lambda self, *a: sent.append(a) or send(self, *a))
    with prefill_server("cpu") as p_url, decode_server("cpu", "reference") as d_url:
        finish = generate(d_url, p_url, prompt(18))["meta_info"]["finish_reason"]
        assert wait_until(lambda: held(p_url) == 0, timeout_s=5.0)
    return finish, len(sent)


def test_records_the_pin_queued_are_done_before_a_decode_server_reads_them(monkeypatch):
    """The pages mail goes at once, the ready mail only once the records are done (and the answer waits for them
    too): the transfer checks out (on a GPU the pinning's records queue behind the step, so a decode server
    reading as soon as the step's result is in could read what the records held before)."""
    finish, mails = records_queued_at_the_pin(monkeypatch, waited=True)
    assert finish["type"] == "length" and mails == 2, finish


def test_the_records_falsifier_an_export_named_before_its_records_are_done_fails_its_check(monkeypatch):
    finish, mails = records_queued_at_the_pin(monkeypatch, waited=False)
    assert finish["type"] == "abort" and "another checksum" in finish["message"] and mails == 2, finish


def read_before_ready(monkeypatch, early_read: bool) -> dict:
    """A prefill server whose KV lands as a GPU's would, simulated on the CPU: as its pages are mailed (the step
    that computes them launched) they hold other bytes, and the KV the forward computed lands 0.3 s later, just
    before the engine has the step's result. A prompt through a decode server by reference: its finish reason.
    `early_read=True`: a mutant decode server that writes the pages as their pages mail lands."""
    from tandem.engine.core import EngineCore
    from tandem.server.disagg_import import KVImports
    from tandem.server.disagg_mailbox import MailSender

    landing = {}
    mail_pinned, pin, ready = MailSender.pinned, EngineCore._pin_launched, EngineCore._exports_ready

    def pin_launched(self, launched):
        landing["pool"] = self.pool
        pin(self, launched)

    def pinned(self, engine_rid, kv, version):
        k = landing["pool"].k_cache
        slots = torch.tensor([p * kv.page_size + i for p in kv.pages for i in range(kv.page_size)])
        landing["kv"] = (k, slots, k[:, slots].clone())
        k[:, slots] = 7.0  # (not yet written: what the pages held before)
        mail_pinned(self, engine_rid, kv, version)

    def exports_ready(self, launched):
        if (held := landing.pop("kv", None)) is not None:
            time.sleep(0.3)
            k, slots, computed = held
            k[:, slots] = computed  # (the forward's write lands)
        ready(self, launched)
    monkeypatch.setattr(MailSender, "pinned", pinned)
    monkeypatch.setattr(EngineCore, "_pin_launched", pin_launched)
    monkeypatch.setattr(EngineCore, "_exports_ready", exports_ready)
    slow_answers(monkeypatch)  # (the ready mail surely lands before the answer, on a busy host too)
    if early_read:
        mailed = KVImports._mailed

        def at_once(self, url, rid, mail, head, payload):
            mailed(self, url, rid, mail, head, payload)
            self._mail_ready(url, rid, mail, {"ready_at": head["pinned_at"], "sent_at": head["sent_at"]}, b"")
        monkeypatch.setattr(KVImports, "_mailed", at_once)
    with prefill_server("cpu") as p_url, decode_server("cpu", "reference") as d_url:
        finish = generate(d_url, p_url, prompt(18))["meta_info"]["finish_reason"]
        record = httpx.get(f"{d_url}/pd/transfers").json()[-1]
        assert wait_until(lambda: held(p_url) == 0, timeout_s=5.0)
    assert record["mailed"], record
    return finish


def test_a_decode_server_reads_pages_mailed_at_the_launch_only_once_they_are_ready(monkeypatch):
    assert read_before_ready(monkeypatch, early_read=False)["type"] == "length"


def test_the_ready_falsifier_pages_read_as_their_mail_lands_fail_their_check(monkeypatch):
    finish = read_before_ready(monkeypatch, early_read=True)
    assert finish["type"] == "abort" and "another checksum" in finish["message"], finish
