"""Weights by reference to another process of this host: `IpcSender`/`IpcReceiver`, the two ends of one
`multiprocessing.Pipe`.

The receiver maps the sender's tensors once and keeps them mapped: the trainer updates its weights in place, so
every later transfer is a small message (the names, the version) and the engine copies from memory it mapped
before. A tensor is (re)mapped when it is new, or no longer the one mapped under its name (other memory, shape,
strides or dtype): the sender keeps every tensor it mapped alive until it replaces it, so no other tensor can sit at
its address meanwhile. Mapping pickles the tensors with torch's sharing reductions (a CUDA IPC handle per tensor,
or shared memory on a CPU, into which a CPU tensor's storage moves at its first send, in place).

One transfer: the sender posts the message; the receiver answers HELD; once the engine's copy is enqueued the
receiver's `release` answers RELEASED, and only then does `send` return. On CUDA the two orderings are kept on the
device (`tandem.transport.handover`): the engine's copy waits for an interprocess event the sender recorded after
its writes, and the sender's stream waits for one the receiver recorded after its copy; no host waits for the
device. Bad input is refused before anything is sent, and the sender says so in the message instead, so the
receiver raises at once. Every wait for the other end is bounded by `timeout_s`.

The pipe is only ever between the two processes that made it, never a network socket: unpickling what arrives on
it is safe, unlike over HTTP.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401 (registers torch's sharing reductions with ForkingPickler)
from torch import Tensor

from tandem.transport.handover import Handover, cuda_device
from tandem.transport.switch import switching
from tandem.transport.weights import (
    NamedTensors,
    TransferStats,
    TransportError,
    WeightReceiver,
    WeightSender,
    aborted,
    check_timeout,
    validated,
)

DIRECT_BYTES = 32 << 10  # a message this small is written from `send`'s thread: the pipe is empty between transfers


@dataclass
class _Transfer:
    """One transfer on the pipe: every name in order, the tensors to (re)map by name (by reference), the sender's
    ready event (CUDA); or (`error` set) its abort."""

    version: int
    names: list[str]
    mapped: dict[str, Tensor] = field(default_factory=dict)
    ready: bytes | None = None  # the IPC handle of the sender's ready event, when it is new
    error: str | None = None


@dataclass
class _Ack:
    kind: str  # "held": the receiver has the tensors; "released": it is done reading them
    done: bytes | None = None  # (held) the IPC handle of the receiver's done event, when it is new
    read: bool = False  # (released) whether it read them (then the sender's stream waits for its done event)


@dataclass(frozen=True)
class Posted:
    """A transfer `IpcSender.post` sent and `settle` has yet to see acknowledged."""

    version: int
    device: torch.device | None
    num_bytes: int
    num_tensors: int
    t0: float  # post's start and end (perf_counter)
    t1: float


def _same(mapped: Tensor | None, tensor: Tensor) -> bool:
    """Whether `tensor` is the memory and layout of `mapped`, which the sender keeps alive (so no other tensor can
    have its address)."""
    return (mapped is not None and mapped.data_ptr() == tensor.data_ptr() and mapped.dtype == tensor.dtype
            and mapped.shape == tensor.shape and mapped.stride() == tensor.stride() and mapped.device == tensor.device)


class _IpcEnd:
    """What both ends share: the connection, the peer's label, the timeout, and failing loudly."""

    peer_rank: int

    def __init__(self, conn: Connection, timeout_s: float, label: str):
        self.conn, self.label = conn, label
        self.timeout_s = check_timeout(timeout_s)
        self.broken: str | None = None

    def _fail(self, message: str) -> TransportError:
        self.broken = message
        return TransportError(f"weights: {message}", ranks=(self.peer_rank,))

    def _begin(self) -> None:
        if self.broken:
            raise TransportError(f"weights: this transport failed earlier ({self.broken}); close it and build a new "
                                 "one")
        if self.conn.closed:
            raise TransportError("weights: this transport is closed")

    def _closed(self, what: str, e: BaseException) -> TransportError:
        return self._fail(f"{self.label} closed the connection before it would {what} (its process ended?): "
                          f"{type(e).__name__}: {e}")

    def _wait(self, what: str) -> tuple[object, float]:
        """The peer's next message, waited for at most the timeout, and the seconds until it began to arrive."""
        t0 = time.perf_counter()
        try:
            if not self.conn.poll(self.timeout_s):
                raise self._fail(f"{self.label} did not {what} within timeout_s={self.timeout_s:g}")
            waited = time.perf_counter() - t0
            return self.conn.recv(), waited
        except (EOFError, OSError) as e:
            raise self._closed(what, e) from e
        except Exception as e:  # unpickling: a tensor that cannot be mapped here, or not a message of ours
            raise self._fail(f"could not read what {self.label} sent: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        self.conn.close()


class IpcSender(_IpcEnd, WeightSender):
    """The trainer's end over `conn`. `label` names the receiver in errors, e.g. "engine process pid 7 at ...".
    `last_mapped`: how many tensors the last `send` (re)mapped."""

    peer_rank = 1

    def __init__(self, conn: Connection, timeout_s: float = 60.0, label: str = "the receiver"):
        super().__init__(conn, timeout_s, label)
        self._mapped: dict[str, Tensor] = {}  # what the receiver has mapped: kept alive here until replaced
        self._ready: torch.cuda.Event | None = None  # recorded here after the trainer's writes; the engine waits
        self._ready_device: torch.device | None = None
        self._done: torch.cuda.Event | None = None  # the receiver's, recorded after its copy; this end waits
        self.last_mapped = 0

    def send(self, named_tensors: NamedTensors, version: int) -> TransferStats:
        """On CUDA, returns once the engine's copy is enqueued, with the caller's current stream waiting for it."""
        with switching():  # this thread wakes at each acknowledgement: take the GIL soon
            return self.settle(self.post(named_tensors, version))

    def post(self, named_tensors: NamedTensors, version: int) -> Posted:
        """`send`'s first half: check the tensors, record the ready event, post the transfer; returns without
        waiting for the receiver. Call `settle` with the result before writing the tensors again, and before the
        next `post`. Raises ValueError on bad input (the receiver hears of the abort), TransportError as `send`."""
        self._begin()
        t0 = time.perf_counter()
        try:
            named = {name: tensor.detach() for name, tensor in validated(named_tensors)}
            device = cuda_device(named)
        except Exception as e:
            self._post(_Transfer(version, [], error=f"{type(e).__name__}: {e}"))
            raise
        remap = {name: t for name, t in named.items() if not _same(self._mapped.get(name), t)}
        new_ready = None
        if device is not None:
            if self._ready is None or self._ready_device != device:
                self._ready, self._ready_device, self._done = torch.cuda.Event(interprocess=True), device, None
                self._ready.record(torch.cuda.current_stream(device))
                new_ready = self._ready.ipc_handle()
            else:
                self._ready.record(torch.cuda.current_stream(device))
        self._post(_Transfer(version, list(named), remap, new_ready))
        self._mapped, self.last_mapped = named, len(remap)
        num_bytes = sum(t.numel() * t.element_size() for t in named.values())
        return Posted(version, device, num_bytes, len(named), t0, time.perf_counter())

    def settle(self, posted: Posted) -> TransferStats:
        """`send`'s second half: wait for the receiver's acknowledgements of `posted` (it held the tensors, then
        released them; each at most the timeout); on CUDA the caller's current stream then waits for the
        receiver's reads. Its stats time the transfer from `post`'s start to the held acknowledgement."""
        version, device = posted.version, posted.device
        held = self._expect("held", f"take weights version {version}")
        if held.done is not None:
            self._done = torch.cuda.Event.from_ipc_handle(device, held.done)
        elif device is not None and self._done is None:
            raise self._fail(f"{self.label} held CUDA tensors without an event to order its reads")
        t2 = time.perf_counter()
        released = self._expect("released", f"release weights version {version}")
        if released.read and device is not None:
            torch.cuda.current_stream(device).wait_event(self._done)
        return TransferStats(version, posted.num_bytes, 1, posted.num_tensors, t2 - posted.t0,
                             phases={"post": posted.t1 - posted.t0, "held": t2 - posted.t1})

    def abandon(self, why: str) -> None:
        """A posted transfer that will not be settled (its acknowledgements stay unread): no later transfer can
        go through this end."""
        self.broken = self.broken or why

    def _post(self, transfer: _Transfer) -> None:
        """Write one transfer, at most the timeout: a message larger than the pipe's buffer blocks its writer until
        the receiver reads, so a large one is written by a thread of its own that a frozen receiver cannot hold up
        `send`."""
        payload = ForkingPickler.dumps(transfer)
        what = f"read weights version {transfer.version}"
        if len(payload) <= DIRECT_BYTES:
            try:
                self.conn.send_bytes(payload)
            except Exception as e:
                raise self._closed(what, e) from e
            return
        written, failed = threading.Event(), []

        def write() -> None:
            try:
                self.conn.send_bytes(payload)
            except Exception as e:  # OSError; or TypeError once `close` took the handle from under a late write
                failed.append(e)
            written.set()

        threading.Thread(target=write, name="tandem-ipc-send", daemon=True).start()
        if not written.wait(self.timeout_s):
            raise self._fail(f"{self.label} did not {what} within timeout_s={self.timeout_s:g}")
        if failed:
            raise self._closed(what, failed[0])

    def _expect(self, kind: str, what: str) -> _Ack:
        got, _ = self._wait(what)
        if not isinstance(got, _Ack) or got.kind != kind:
            raise self._fail(f"{self.label} answered {got!r} where it would {what}")
        return got


class IpcReceiver(_IpcEnd, WeightReceiver):
    """The engine's end over `conn`. The received tensors (a `Handover`) are the sender's memory, mapped into this
    process (on the sender's device) at their first transfer and kept mapped; `release` lets the sender go on.
    `label` names the sender in errors."""

    peer_rank = 0

    def __init__(self, conn: Connection, timeout_s: float = 60.0, label: str = "the sender"):
        super().__init__(conn, timeout_s, label)
        self._mapped: dict[str, Tensor] = {}
        self._ready: torch.cuda.Event | None = None
        self._done: torch.cuda.Event | None = None
        self._held: Handover | None = None

    def receive(self) -> tuple[int, Handover]:
        self._begin()
        self.release()  # the last transfer's, if its reader did not
        t0 = time.perf_counter()
        transfer, wait_s = self._wait("send weights")  # unpickling maps new tensors: IPC handles or shared memory
        if transfer.error is not None:
            raise TransportError(f"weights: {aborted(self.label, transfer.version, transfer.error)}", ranks=(0,))
        mapped = {name: transfer.mapped.get(name, self._mapped.get(name)) for name in transfer.names}
        if unknown := [name for name, t in mapped.items() if t is None]:
            raise self._fail(f"{self.label} sent {unknown[:3]} by a mapping this end never had")
        self._mapped = mapped  # (tensors no longer named are unmapped)
        device, new_done = cuda_device(mapped), None
        if device is not None and transfer.ready is None and self._ready is None:
            raise self._fail(f"{self.label} sent CUDA tensors without an event to order them")
        if transfer.ready is not None:
            self._ready = torch.cuda.Event.from_ipc_handle(device, transfer.ready)
            self._done = torch.cuda.Event(interprocess=True)
            with torch.cuda.device(device):
                new_done = self._done.ipc_handle()
        self._held = Handover(dict(mapped), device, self._ready, self._done)
        self._send(_Ack("held", done=new_done), f"hear that weights version {transfer.version} are held")
        num_bytes = sum(t.numel() * t.element_size() for t in mapped.values())
        t2 = time.perf_counter()
        self.last_stats = TransferStats(transfer.version, num_bytes, 1, len(mapped), t2 - t0, wait_s,
                                        {"wait": wait_s, "map": t2 - t0 - wait_s})
        return transfer.version, self._held

    def release(self) -> None:
        """Once the engine's copy is enqueued (on CUDA the sender's stream waits for it on the device)."""
        if self._held is None:
            return
        held, self._held = self._held, None
        held.release()
        self._send(_Ack("released", read=held.read), "hear that the weights are released")

    def _send(self, ack: _Ack, what: str) -> None:
        try:
            self.conn.send(ack)
        except OSError as e:
            raise self._closed(what, e) from e
