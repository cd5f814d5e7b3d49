"""Weight transport: how a new policy travels from the trainer to the engine(s).

One tiny interface, `WeightSender` (trainer) and `WeightReceiver` (engine), with two implementations:
`InProcessSender`/`InProcessReceiver` here, a one-slot hand-off between threads of one process, and
`DistSender`/`DistReceiver` (`tandem.transport.dist`), bucketed broadcasts over a dedicated torch.distributed group.
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from torch import Tensor

NamedTensors = Iterable[tuple[str, Tensor]]
NamedWeights = Mapping[str, Tensor] | NamedTensors


def as_mapping(named: NamedWeights) -> Mapping[str, Tensor]:
    """A mapping as it is (a `FlatTensors` keeps its buffers), pairs read into a dict."""
    return named if isinstance(named, Mapping) else dict(named)


class FlatTensors(Mapping[str, Tensor]):
    """Named tensors as a transport received them: `buckets` holds (names, shapes, flat_N) per flat buffer, its
    tensors back to back in their order. A consumer that copies whole buffers (`WeightLoader`) reads `buckets` and
    makes no per-tensor view; as a mapping, each tensor's view is made when first asked for. (Making the 310 views of
    the 0.6B shape took its receive 1 ms, and 6-7 ms beside an engine busy generating.)"""

    def __init__(self, buckets: list[tuple[list[str], list[list[int]], Tensor]]):
        self.buckets = buckets
        self._where: dict[str, tuple[Tensor, int, list[int]]] | None = None

    def _index(self) -> dict[str, tuple[Tensor, int, list[int]]]:
        if self._where is None:
            self._where = {}
            for names, shapes, flat_N in self.buckets:
                offset = 0
                for name, shape in zip(names, shapes, strict=True):
                    self._where[name] = (flat_N, offset, shape)
                    offset += math.prod(shape)
        return self._where

    def __getitem__(self, name: str) -> Tensor:
        flat_N, offset, shape = self._index()[name]
        return flat_N[offset:offset + math.prod(shape)].view(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index())

    def __len__(self) -> int:
        return len(self._index())


class TransportError(RuntimeError):
    """A transfer failed: a peer is missing, died, timed out or aborted. `ranks`: the peers concerned;
    `bucket`: the bucket index, None outside the buckets."""

    def __init__(self, message: str, ranks: Iterable[int] = (), bucket: int | None = None):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.bucket = bucket


@dataclass
class TransferStats:
    """One transfer as one end saw it; `seconds` from the hello to the last acknowledgement, of which `wait_s`
    waiting for the other end(s) to start (the sender: until every engine said hello). `phases`: where
    this end's time went (seconds by phase, in order), where the transport times it."""

    version: int
    num_bytes: int
    num_buckets: int
    num_tensors: int
    seconds: float
    wait_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else math.inf


class _Transport(ABC):
    """Either end: closed on leaving a `with` block."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection; idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class WeightSender(_Transport):
    """The trainer's end."""

    @abstractmethod
    def send(self, named_tensors: NamedTensors, version: int) -> TransferStats:
        """Send full (unsharded) tensors by Hugging Face name as weight `version`. Blocks until every receiver holds
        all of them; raises TransportError when a receiver is missing, dies or stalls past the timeout, ValueError
        on bad input (a duplicate name, a non-tensor). Reads the tensors and never mutates them; once it returns
        they may change, the receivers hold copies. `named_tensors` may be a generator (consumed once)."""


class WeightReceiver(_Transport):
    """The engine's end."""

    @abstractmethod
    def receive(self) -> tuple[int, Mapping[str, Tensor]]:
        """Block until the sender's next `send` has fully arrived; return (version, {name: tensor}), ready for
        `load_weights` or `Engine.update_weights` (pass the mapping itself: `FlatTensors` load buffer by buffer).
        The tensors belong to the receiver (never aliases of the sender's; several may be views of one flat
        buffer). Raises TransportError when the sender does not start, stalls past the timeout, or aborts the
        transfer."""


# ---- in-process ------------------------------------------------------------------------------------------------


class InProcessReceiver(WeightReceiver):
    """The engine's end of a one-slot, queue-free hand-off between threads of one process:
    `InProcessSender.send` puts a transfer in the slot and waits until `receive` takes it."""

    def __init__(self, timeout_s: float = 60.0):
        self.timeout_s = check_timeout(timeout_s)
        self._cond = threading.Condition()
        self._slot: tuple[int, dict[str, Tensor]] | None = None

    def receive(self) -> tuple[int, dict[str, Tensor]]:
        with self._cond:
            if not self._cond.wait_for(lambda: self._slot is not None, self.timeout_s):
                raise TransportError(f"weights: the in-process sender sent nothing within timeout_s={self.timeout_s:g}")
            transfer, self._slot = self._slot, None
            self._cond.notify_all()
        return transfer

    def close(self) -> None:
        pass

    def _hand_over(self, version: int, tensors: dict[str, Tensor], timeout_s: float) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._slot is None, timeout_s):
                raise TransportError("weights: the in-process receiver has not taken the previous transfer")
            self._slot = offered = (version, tensors)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._slot is not offered, timeout_s):
                self._slot = None  # withdrawn: a late receive must not get a transfer the sender reported as failed
                raise TransportError(f"weights: the in-process receiver took nothing within timeout_s={timeout_s:g}")


class InProcessSender(WeightSender):
    """The trainer's end of the in-process hand-off: one bucket of copies, so the engine never aliases the
    trainer's parameters (the optimizer mutates them in place)."""

    def __init__(self, receiver: InProcessReceiver, timeout_s: float = 60.0):
        self.receiver = receiver
        self.timeout_s = check_timeout(timeout_s)

    def send(self, named_tensors: NamedTensors, version: int) -> TransferStats:
        t0 = time.perf_counter()
        tensors = {name: tensor.detach().clone() for name, tensor in validated(named_tensors)}
        self.receiver._hand_over(version, tensors, self.timeout_s)
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return TransferStats(version, num_bytes, 1, len(tensors), time.perf_counter() - t0)

    def close(self) -> None:
        pass


def validated(named_tensors: NamedTensors) -> Iterator[tuple[str, Tensor]]:
    """The pairs, checked as they pass: (str, Tensor) each, no name twice."""
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if not isinstance(name, str) or not isinstance(tensor, Tensor):
            raise ValueError(f"named_tensors: expected (str, Tensor) pairs, got ({type(name).__name__}, "
                             f"{type(tensor).__name__})")
        if name in seen:
            raise ValueError(f"named_tensors: {name!r} is given twice")
        seen.add(name)
        yield name, tensor


def check_timeout(timeout_s: float) -> float:
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: must be positive, got {timeout_s!r}")
    return float(timeout_s)
