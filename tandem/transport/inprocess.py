"""The in-process weight transport: a one-slot, queue-free hand-off of copies between threads of one process."""

from __future__ import annotations

import threading
import time

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


class InProcessReceiver(WeightReceiver):
    """The engine's end: `receive` takes what `InProcessSender.send` put in the slot (a transfer, or its abort)."""

    def __init__(self, timeout_s: float = 60.0):
        self.timeout_s = check_timeout(timeout_s)
        self._cond = threading.Condition()
        self._slot: tuple[int, dict[str, Tensor] | TransportError] | None = None

    def receive(self) -> tuple[int, dict[str, Tensor]]:
        t0 = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: self._slot is not None, self.timeout_s):
                raise TransportError(f"weights: the in-process sender sent nothing within timeout_s={self.timeout_s:g}",
                                     ranks=(0,))
            (version, tensors), self._slot = self._slot, None
            self._cond.notify_all()
        if isinstance(tensors, TransportError):
            raise tensors
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.last_stats = TransferStats(version, num_bytes, 1, len(tensors), time.perf_counter() - t0)
        return version, tensors

    def close(self) -> None:
        pass

    def _hand_over(self, version: int, tensors: dict[str, Tensor] | TransportError, timeout_s: float) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._slot is None, timeout_s):
                raise TransportError("weights: the in-process receiver has not taken the previous transfer",
                                     ranks=(1,))
            self._slot = offered = (version, tensors)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._slot is not offered, timeout_s):
                self._slot = None  # withdrawn: a late receive must not get a transfer the sender reported as failed
                raise TransportError(f"weights: the in-process receiver took nothing within timeout_s={timeout_s:g}",
                                     ranks=(1,))


class InProcessSender(WeightSender):
    """The trainer's end: one bucket of copies, so the engine never aliases the trainer's parameters (the optimizer
    mutates them in place)."""

    def __init__(self, receiver: InProcessReceiver, timeout_s: float = 60.0):
        self.receiver = receiver
        self.timeout_s = check_timeout(timeout_s)

    def send(self, named_tensors: NamedTensors, version: int) -> TransferStats:
        t0 = time.perf_counter()
        try:
            tensors = {name: tensor.detach().clone() for name, tensor in validated(named_tensors)}
        except Exception as e:
            abort = TransportError(f"weights: {aborted('the in-process sender', version, e)}", ranks=(0,))
            self.receiver._hand_over(version, abort, self.timeout_s)
            raise
        self.receiver._hand_over(version, tensors, self.timeout_s)
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return TransferStats(version, num_bytes, 1, len(tensors), time.perf_counter() - t0)

    def close(self) -> None:
        pass
