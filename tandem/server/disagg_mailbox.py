"""The side channel of the KV transfer by reference (`tandem.server.disagg` states the protocol): a pinned export's
pages sent straight from the prefill engine's thread to the decode server that asked for the prompt, over a Unix socket
of that decode server (`Mailbox`, in its event loop; `MailSender`, the prefill server's end): a pages mail as the engine
pins them (as it launches the step that completes the prompt, before the device has run it), then a ready mail once the
engine has that step's result. It takes off the transfer's way what the HTTP answer has on it: the prefill engine
finishing the request (its prefix-cache insert), the hop to its server's thread, the answer built, and its way through
the two HTTP stacks; and the pages mail takes the decode server's parsing and preparing off the way too (done while the
prefill computes). The decode server writes and checks the KV as the ready mail lands (into the pages its engine set
aside, `Engine.write_reserved`), never before. The HTTP answer still comes and stays the authority: it must name the
same pages under the same weight version (else the request ends with an abort), it carries the first token, and the
export is released only after it (so a release never comes before the prefill server holds the export). Where no mail
comes first (no socket, a failed send, a late one), the answer's way is taken as before: a mail is an early copy of what
the answer carries, never needed.

A frame: two little-endian uint32 (the JSON head's length, the payload's), the head, the payload. Head: `kind`,
`rid` (the key the decode server gave this attempt at its request, `MAIL_KEY_HEADER`), `sent_at`
(`time.monotonic()` as it was sent). A "pages" head also has `pool`, `start`, `end`, `page_size`, `version` (the
KV's weight version), `pinned_at`, `pin_s` (as the prefill engine began pinning, its time pinning), its payload the
pages (int32), then their epochs (int64, `PinnedKV.epochs`), little-endian. A "ready" head has `rung` (whether its
doorbell was rung first) and `ready_at` (as the prefill engine had the step's result, `PinnedKV.ready_at`), no
payload; it follows its pages mail on one stream.
Each prefill server connects once, its stream written by its engine's thread alone. Sockets are in Linux's abstract
namespace (no file to clean up); both servers are on one host (a reference's pairing checks it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np

from tandem.engine.doorbell import ring
from tandem.engine.kv_mapped import MappedKV, MappedPool, PinnedKV

log = logging.getLogger("tandem.server.disagg")

MAILBOX_HEADER = "X-Tandem-Mailbox"  # a decode server's `/pd/prefill`: the name of its `Mailbox`
MAIL_KEY_HEADER = "X-Tandem-Mail-Key"  # and the key its mail is to carry (`rid`: one of this request's attempt)
DOORBELL_HEADER = "X-Tandem-Doorbell"  # and a doorbell to ring once the KV is complete (`doorbell.Bell.spec`)
_FRAME = struct.Struct("<II")
MAX_FRAME_BYTES = 64 << 20  # (a mail names pages: a million of them is a few MB)


def _address(name: str) -> str:
    """A mailbox name as a socket address in the abstract namespace."""
    return "\0" + name


class Mailbox:
    """A decode server's end: a Unix socket its prefill servers send to (`name`, in the `MAILBOX_HEADER` of its
    requests), each frame handed to the request waiting for it (`expect`) as its last byte is read, in the same turn
    of the server's event loop (`_Frames`). Runs in that loop."""

    def __init__(self):
        self.name = f"tandem-pd-{uuid.uuid4().hex}"
        # (key, kind) -> the frame's future, and what is called with it first
        self._waiting: dict[tuple[str, str], tuple[asyncio.Future, Callable[[dict, bytes], None] | None]] = {}
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Transport] = set()  # (one a prefill server connected)

    async def start(self) -> None:
        if self._server is None:
            self._server = await asyncio.get_running_loop().create_unix_server(lambda: _Frames(self),
                                                                                path=_address(self.name))

    def expect(self, rid: str, kind: str, on_frame: Callable[[dict, bytes], None] | None = None) -> asyncio.Future:
        """A future for `rid`'s frame of `kind`: (head, payload); `on_frame(head, payload)`, if given, is called
        with it before the future is done, as the frame lands (what it raises is logged). Cancel the future (or
        let it be) when no longer wanted: a frame nobody waits for is dropped."""
        key = (rid, kind)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[key] = fut, on_frame
        fut.add_done_callback(lambda f: self._waiting.pop(key, None) if self._waiting.get(key, (None,))[0] is f
                              else None)
        return fut

    def _deliver(self, head: dict, payload: bytes) -> None:
        fut, on_frame = self._waiting.get((str(head.get("rid")), head.get("kind")), (None, None))
        if fut is None or fut.done():
            return
        if on_frame is not None:
            try:
                on_frame(head, payload)
            except Exception:
                log.exception("decode server: handling the mail of %s failed", head.get("rid"))
        if not fut.done():
            fut.set_result((head, payload))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for transport in list(self._connections):
                transport.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        for fut, _ in list(self._waiting.values()):
            fut.cancel()


class _Frames(asyncio.Protocol):
    """One prefill server's connection to a `Mailbox`: its bytes cut into frames, each delivered as it completes.
    A frame that does not parse, or claims more than `MAX_FRAME_BYTES`, closes the connection (logged)."""

    def __init__(self, box: Mailbox):
        self.box, self.buffer = box, bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.box._connections.add(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.box._connections.discard(self.transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while len(self.buffer) >= _FRAME.size and not self.transport.is_closing():
            head_len, payload_len = _FRAME.unpack_from(self.buffer)
            end = _FRAME.size + head_len + payload_len
            try:
                if end > MAX_FRAME_BYTES:
                    raise ValueError(f"a frame of {end} bytes (at most {MAX_FRAME_BYTES})")
                if len(self.buffer) < end:
                    return
                head = json.loads(self.buffer[_FRAME.size:_FRAME.size + head_len])
                if not isinstance(head, dict):
                    raise ValueError("its head is no JSON object")
            except ValueError as e:  # (UnicodeDecodeError and JSONDecodeError too)
                log.warning("decode server: a mailbox frame did not parse (%s: %s); the connection is dropped",
                            type(e).__name__, e)
                self.buffer.clear()
                self.transport.close()
                return
            payload = bytes(self.buffer[_FRAME.size + head_len:end])
            del self.buffer[:end]
            self.box._deliver(head, payload)


def mapped_from_mail(source: MappedPool, head: dict, payload: bytes, origin: str) -> MappedKV:
    """The KV a pages mail names, as a `MappedKV` of the pool `source`; ValueError if it does not parse or name
    pages of that pool."""
    try:
        if len(payload) % 12:
            raise ValueError(f"{len(payload)} bytes are no pages (int32) and their epochs (int64)")
        n = len(payload) // 12
        handle = {"kind": "pages", "pool": head["pool"], "start": head["start"], "end": head["end"],
                  "page_size": head["page_size"], "pages": np.frombuffer(payload, dtype="<i4", count=n),
                  "epochs": np.frombuffer(payload, dtype="<i8", offset=4 * n)}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"kv transfer: the mail is not a KV by reference ({type(e).__name__}: {e})") from None
    return MappedKV(source, handle, origin)


class MailSender:
    """A prefill server's end: `expect(engine_rid, rid, name)` (its handler, in its event loop, before the engine
    computes the prompt; it connects to mailbox `name` where not yet connected) says that the export of engine
    request `engine_rid` goes to that mailbox as decode request `rid`; `pinned(engine_rid, kv, version)` (the
    engine's hook, in its thread, as the step completing the prompt is launched: quick, never blocks nor raises)
    sends its pages mail, and `ready(engine_rid, kv)` (the engine's hook once it has that step's result) rings the
    doorbell `expect` was given (`bell`: `doorbell.Bell.spec`, from the `DOORBELL_HEADER`; the decode server's device
    may have that export's pass queued behind it), then sends its ready mail. Sends never block (a frame is sent
    whole or its connection dropped, logged): the answer's way remains. `forget(engine_rid)` once the handler is
    done."""

    def __init__(self):
        self._expected: dict[str, tuple[str, str, str | None]] = {}  # engine rid -> (rid, mailbox, doorbell)
        self._pinned: dict[str, tuple[str, str, str | None, PinnedKV]] = {}  # ... and the export mailed
        self._sockets: dict[str, socket.socket] = {}  # mailbox -> its connection (written by the engine's thread)
        self._lock = threading.Lock()  # (connections are made in the event loop, dropped in either thread)
        self._unringable: set[str] = set()  # mailboxes whose decode server's doorbell could not be rung

    def expect(self, engine_rid: str, rid: str, name: str, bell: str | None = None) -> None:
        try:
            self._connect(name)
        except OSError as e:
            log.warning("prefill server: no mail to %s (%s: %s); its KV takes the answer's way", name,
                        type(e).__name__, e)
            return
        self._expected[engine_rid] = (rid, name, bell)

    def forget(self, engine_rid: str) -> None:
        self._expected.pop(engine_rid, None)
        self._pinned.pop(engine_rid, None)

    def pinned(self, engine_rid: str, kv: PinnedKV, version: int) -> None:
        self._pinned.pop(engine_rid, None)  # (pinned again: the pages mailed before are never said ready)
        if (to := self._expected.pop(engine_rid, None)) is None or kv.routing is not None:
            return  # (routed experts come with the answer alone)
        rid, name, bell = to
        head = {"kind": "pages", "rid": rid, "pool": kv.pool_id, "start": kv.start, "end": kv.end,
                "page_size": kv.page_size, "version": version, "pinned_at": kv.pinned_at, "pin_s": kv.read_s}
        if self._send(name, head, np.asarray(kv.pages, dtype="<i4").tobytes()
                      + np.asarray(kv.epochs, "<i8").tobytes()):
            self._pinned[engine_rid] = (rid, name, bell, kv)

    def ready(self, engine_rid: str, kv: PinnedKV) -> None:
        """(Only for the export whose pages were mailed.)"""
        if (to := self._pinned.get(engine_rid)) is None or to[3] is not kv:
            return
        del self._pinned[engine_rid]
        rid, name, bell, _ = to
        kv.wait_recorded()  # (the records of pages the forward did not write: queued right behind the step just run)
        rung = False
        if bell is not None and name not in self._unringable:
            try:
                ring(bell)
                rung = True
            except ValueError as e:  # (once a mailbox: its later bells are not tried)
                self._unringable.add(name)
                log.warning("prefill server: %s; the decode server of mailbox %s rings its bells itself as its ready "
                            "mails land", e, name)
        self._send(name, {"kind": "ready", "rid": rid, "ready_at": kv.ready_at, "rung": rung}, b"")

    def _send(self, name: str, head: dict, payload: bytes) -> bool:
        """Send one frame to mailbox `name`, without blocking; False (the connection dropped) if it fails or would
        block: a frame is sent whole or the stream is closed."""
        sock = self._sockets.get(name)
        if sock is None:
            return False
        head["sent_at"] = time.monotonic()
        data = json.dumps(head).encode()
        frame = _FRAME.pack(len(data), len(payload)) + data + payload
        try:
            if sock.send(frame) != len(frame):  # (a non-blocking socket: BlockingIOError if full)
                raise BlockingIOError("the mailbox's buffer is full")
            return True
        except OSError as e:
            log.warning("prefill server: a mail to %s failed (%s: %s); its KV takes the answer's way", name,
                        type(e).__name__, e)
            with self._lock:
                if self._sockets.get(name) is sock:
                    del self._sockets[name]
            sock.close()
            return False

    def _connect(self, name: str) -> None:
        with self._lock:
            if name in self._sockets:
                return
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(1.0)
                sock.connect(_address(name))
                sock.settimeout(0.0)  # (sends never block the engine's thread)
            except OSError:
                sock.close()
                raise
            self._sockets[name] = sock

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets.values():
                sock.close()
            self._sockets.clear()
