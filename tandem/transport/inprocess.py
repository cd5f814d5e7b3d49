"""The in-process weight transport: the trainer's tensors handed by reference (`Handover`) to the engine's thread
through a one-slot, queue-free hand-off. Nothing is copied but the engine's own copy into its parameters; on CUDA
that copy waits for the trainer's writes and the trainer's next writes wait for it, on the device."""

from __future__ import annotations

import threading
import time

from tandem.transport.handover import Handover, by_reference, cuda_device, record_ready
from tandem.transport.weights import (
    NamedTensors,
    TransferStats,
    TransportError,
    WeightReceiver,
    WeightSender,
    aborted,
    check_timeout,
)


def _stats(version: int, handover: Handover, seconds: float, phases: dict[str, float] | None = None) -> TransferStats:
    num_bytes = sum(t.nbytes for t in handover.tensors.values())
    return TransferStats(version, num_bytes, 1, len(handover), seconds, phases=phases or {})


class InProcessReceiver(WeightReceiver):
    """The engine's end: `receive` takes what `InProcessSender.send` put in the slot (a transfer, or its abort);
    the tensors are the sender's own (read them through `WeightLoader`, which honours the `Handover`'s ordering),
    and `send` returns only once `release` was called."""

    def __init__(self, timeout_s: float = 60.0):
        self.timeout_s = check_timeout(timeout_s)
        self._cond = threading.Condition()
        self._slot: tuple[int, Handover | TransportError] | None = None
        self._held: Handover | None = None

    def receive(self) -> tuple[int, Handover]:
        self.release()  # the last transfer's, if its reader did not
        t0 = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: self._slot is not None, self.timeout_s):
                raise TransportError(f"weights: the in-process sender sent nothing within timeout_s={self.timeout_s:g}",
                                     ranks=(0,))
            (version, handover), self._slot = self._slot, None
            if not isinstance(handover, TransportError):
                self._held = handover
            self._cond.notify_all()
        if isinstance(handover, TransportError):
            raise handover
        self.last_stats = _stats(version, handover, time.perf_counter() - t0)
        return version, handover

    def take(self, version: int, handover: Handover) -> tuple[int, Handover]:
        """`receive` for a transfer offered in this thread (`InProcessSender.offer`): no hand-off, no wait."""
        self.release()
        with self._cond:
            self._held = handover
        self.last_stats = _stats(version, handover, 0.0)
        return version, handover

    def release(self) -> None:
        with self._cond:
            held, self._held = self._held, None
            if held is not None:
                held.release()
                self._cond.notify_all()

    def close(self) -> None:
        pass

    def _hand_over(self, version: int, handover: Handover | TransportError, timeout_s: float) -> float:
        """Put the transfer in the slot; wait until it is taken (returns the seconds until then) and, unless an
        abort, released."""
        t0 = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: self._slot is None, timeout_s):
                raise TransportError("weights: the in-process receiver has not taken the previous transfer",
                                     ranks=(1,))
            self._slot = offered = (version, handover)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._slot is not offered, timeout_s):
                self._slot = None  # withdrawn: a late receive must not get a transfer the sender reported as failed
                raise TransportError(f"weights: the in-process receiver took nothing within timeout_s={timeout_s:g}",
                                     ranks=(1,))
            taken_s = time.perf_counter() - t0
            if isinstance(handover, Handover) and not self._cond.wait_for(lambda: handover.released, timeout_s):
                handover.release()  # a late load must not read what the trainer is about to change
                raise TransportError(f"weights: the in-process receiver did not release weights version {version} "
                                     f"within timeout_s={timeout_s:g}", ranks=(1,))
        return taken_s


class InProcessSender(WeightSender):
    """The trainer's end. The engine reads the trainer's tensors themselves, never keeps them: it copies them into
    its own parameters (the optimizer mutates the trainer's in place), and `send` returns once it released them."""

    def __init__(self, receiver: InProcessReceiver, timeout_s: float = 60.0):
        self.receiver = receiver
        self.timeout_s = check_timeout(timeout_s)

    @staticmethod
    def offer(named_tensors: NamedTensors) -> Handover:
        """The tensors by reference, checked (ValueError: a duplicate name, a non-tensor, tensors on several
        devices), with the event the engine's copy waits for recorded on the caller's current stream."""
        tensors = by_reference(named_tensors)
        device = cuda_device(tensors)
        return Handover(tensors, device, record_ready(device))

    def send(self, named_tensors: NamedTensors, version: int) -> TransferStats:
        """On CUDA, returns once the engine's copy is enqueued, with the caller's current stream waiting for it."""
        t0 = time.perf_counter()
        try:
            handover = self.offer(named_tensors)
        except Exception as e:
            abort = TransportError(f"weights: {aborted('the in-process sender', version, e)}", ranks=(0,))
            self.receiver._hand_over(version, abort, self.timeout_s)
            raise
        t1 = time.perf_counter()
        taken_s = self.receiver._hand_over(version, handover, self.timeout_s)
        handover.wait_read()
        return _stats(version, handover, t1 - t0 + taken_s, {"offer": t1 - t0, "held": taken_s})

    def close(self) -> None:
        pass
