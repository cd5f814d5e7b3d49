"""Weight transport: how a new policy travels from the trainer to the engine(s).

One tiny interface, `WeightSender` (trainer) and `WeightReceiver` (engine), with three implementations:
`InProcessSender`/`InProcessReceiver` (`tandem.transport.inprocess`), a one-slot hand-off of the tensors by reference
between threads of one process; `IpcSender`/`IpcReceiver` (`tandem.transport.ipc`), the tensors by reference to
another process of the host (CUDA IPC, or shared memory on a CPU), mapped once; `DistSender`/`DistReceiver`
(`tandem.transport.dist`), bucketed broadcasts over a dedicated torch.distributed group. The two by reference hand
the engine a `Handover` (`tandem.transport.handover`), whose reads `WeightLoader` orders on the device. The engine's
end of a whole sync (receive, load, release) is `tandem.transport.sync.receive_and_load`, the same for all three.
"""

from __future__ import annotations

import math
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
    makes no per-tensor view; as a mapping, each tensor's view is made when first asked for."""

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
    """A transfer failed: a peer is missing, died, timed out or aborted. `ranks`: the peers concerned (0: the
    sender, 1..N: the receivers); `bucket`: the bucket index, None outside the buckets."""

    def __init__(self, message: str, ranks: Iterable[int] = (), bucket: int | None = None):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.bucket = bucket


@dataclass
class TransferStats:
    """One transfer as one end saw it; `seconds` from its start to the other end's last acknowledgement, of which
    `wait_s` waiting for the other end(s) to start, where the transport can tell. `phases`: where this end's time
    went (seconds by phase, in order, summing to `seconds`), where the transport times it."""

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
    """Either end: closed on leaving a `with` block. After a TransportError other than an abort (a timeout, a dead
    peer) an end may refuse further transfers: close it and build a new one."""

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
        """Send full (unsharded) tensors by Hugging Face name as weight `version`. Blocks until the tensors may change
        again: every receiver holds a copy, or (by reference: in-process, ipc) has released them; on CUDA, by
        reference, the receiver's copy may still be queued then, and the caller's current stream waits for it (write
        the tensors again on that stream, or after it). Reads the tensors and never mutates them. `named_tensors`
        may be a generator (consumed once).
        Raises ValueError on bad input (a duplicate name, a non-tensor), after telling the receivers, whose `receive`
        then raises a TransportError saying the transfer of `version` was aborted (nothing of it is loaded).
        Raises TransportError naming the receiver when one is missing, dies or stalls past the timeout."""


class WeightReceiver(_Transport):
    """The engine's end. `last_stats`: the last completed `receive` as this end saw it."""

    last_stats: TransferStats | None = None

    @abstractmethod
    def receive(self) -> tuple[int, Mapping[str, Tensor]]:
        """Block until the sender's next `send` has fully arrived; return (version, {name: tensor}), ready for
        `load_weights` or `Engine.load_paused` (pass the mapping itself: `FlatTensors` load buffer by buffer).
        The tensors are valid until `release`: copies owned by the receiver (several may be views of one flat
        buffer), or (in-process, ipc: a `Handover`) the sender's own memory, which it keeps unchanged until then.
        Raises TransportError naming the sender when it does not start, stalls past the timeout, or aborts the
        transfer."""

    def release(self) -> None:  # noqa: B027 (the copying transports have nothing to release)
        """Done reading the tensors of the last `receive`. Call it once they are loaded, also when loading failed.
        A transport by reference then refuses reads that had not started, and lets the sender's `send` return (its
        stream waits on the device for the reads enqueued); the copying transports need nothing."""


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


def aborted(who: str, version: int, error: BaseException | str) -> str:
    """The message of a receiver whose sender aborted the transfer (the same words in every transport)."""
    reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return f"{who} aborted the transfer of version {version}: {reason}"


def check_timeout(timeout_s: float) -> float:
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: must be positive, got {timeout_s!r}")
    return float(timeout_s)
