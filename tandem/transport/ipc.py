"""Weights by reference to another process of this host: `IpcSender`/`IpcReceiver`, the two ends of one
`multiprocessing.Pipe`.

One transfer: the sender pickles the tensors with torch's sharing reductions (a CUDA IPC handle per tensor, or
shared memory on a CPU) into one message; the receiver maps them and answers HELD; once the engine has copied them
into its parameters the receiver's `release` waits for that copy to finish on the device and answers RELEASED, and
only then does `send` return: until then the engine reads the trainer's own memory, so the trainer must not change
it. Nothing is copied in between. Bad input is refused before anything is sent, and the sender says so in the
message instead, so the receiver raises at once. Every wait for the other end is bounded by `timeout_s`.

The pipe is only ever between the two processes that made it, never a network socket: unpickling what arrives on
it is safe, unlike over HTTP.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401 (registers torch's sharing reductions with ForkingPickler)
from torch import Tensor

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


@dataclass
class _Transfer:
    """One transfer on the pipe: the tensors by reference, or (`error` set, no tensors) its abort."""

    version: int
    names: list[str]
    tensors: list[Tensor]
    error: str | None = None


class _Ack(enum.Enum):
    HELD = 1  # the receiver mapped the tensors
    RELEASED = 2  # the receiver is done reading them


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
    A CPU tensor's storage moves into shared memory at its first send (in place: the tensor stays valid)."""

    peer_rank = 1

    def __init__(self, conn: Connection, timeout_s: float = 60.0, label: str = "the receiver"):
        super().__init__(conn, timeout_s, label)

    def send(self, named_tensors: NamedTensors, version: int) -> TransferStats:
        self._begin()
        t0 = time.perf_counter()
        try:
            named = [(name, tensor.detach()) for name, tensor in validated(named_tensors)]
        except Exception as e:
            self._post(_Transfer(version, [], [], f"{type(e).__name__}: {e}"))
            raise
        self._post(_Transfer(version, [name for name, _ in named], [tensor for _, tensor in named]))
        t1 = time.perf_counter()
        self._expect(_Ack.HELD, f"take weights version {version}")
        t2 = time.perf_counter()
        self._expect(_Ack.RELEASED, f"release weights version {version}")
        num_bytes = sum(t.numel() * t.element_size() for _, t in named)
        return TransferStats(version, num_bytes, 1, len(named), t2 - t0, phases={"post": t1 - t0, "held": t2 - t1})

    def _post(self, transfer: _Transfer) -> None:
        """Write one transfer, at most the timeout: a message larger than the pipe's buffer blocks its writer until
        the receiver reads, so it is written by a thread of its own that a frozen receiver cannot hold up `send`."""
        payload = ForkingPickler.dumps(transfer)
        written, failed = threading.Event(), []

        def write() -> None:
            try:
                self.conn.send_bytes(payload)
            except Exception as e:  # OSError; or TypeError once `close` took the handle from under a late write
                failed.append(e)
            written.set()

        threading.Thread(target=write, name="tandem-ipc-send", daemon=True).start()
        what = f"read weights version {transfer.version}"
        if not written.wait(self.timeout_s):
            raise self._fail(f"{self.label} did not {what} within timeout_s={self.timeout_s:g}")
        if failed:
            raise self._closed(what, failed[0])

    def _expect(self, ack: _Ack, what: str) -> None:
        got, _ = self._wait(what)
        if got is not ack:
            raise self._fail(f"{self.label} answered {got!r} where it would {what}")


class IpcReceiver(_IpcEnd, WeightReceiver):
    """The engine's end over `conn`. The received tensors are the sender's memory, mapped into this process
    (on the sender's device); `release` lets the sender go on. `label` names the sender in errors."""

    peer_rank = 0

    def __init__(self, conn: Connection, timeout_s: float = 60.0, label: str = "the sender"):
        super().__init__(conn, timeout_s, label)
        self._held: list[Tensor] | None = None

    def receive(self) -> tuple[int, dict[str, Tensor]]:
        self._begin()
        self.release()  # the last transfer's, if its reader did not
        t0 = time.perf_counter()
        transfer, wait_s = self._wait("send weights")  # unpickling maps the tensors: IPC handles or shared memory
        if transfer.error is not None:
            raise TransportError(f"weights: {aborted(self.label, transfer.version, transfer.error)}", ranks=(0,))
        self._held = transfer.tensors
        self._send(_Ack.HELD, f"hear that weights version {transfer.version} are held")
        num_bytes = sum(t.numel() * t.element_size() for t in transfer.tensors)
        t2 = time.perf_counter()
        self.last_stats = TransferStats(transfer.version, num_bytes, 1, len(transfer.names), t2 - t0, wait_s,
                                        {"wait": wait_s, "map": t2 - t0 - wait_s})
        return transfer.version, dict(zip(transfer.names, transfer.tensors, strict=True))

    def release(self) -> None:
        if self._held is None:
            return
        for device in {t.device for t in self._held if t.is_cuda}:
            torch.cuda.synchronize(device)  # the copies out of the sender's memory ran on some stream of ours
        self._held = None
        self._send(_Ack.RELEASED, "hear that the weights are released")

    def _send(self, ack: _Ack, what: str) -> None:
        try:
            self.conn.send(ack)
        except OSError as e:
            raise self._closed(what, e) from e
