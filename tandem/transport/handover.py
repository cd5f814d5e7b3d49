"""Tensors handed over by reference (`Handover`): what a receiver gets when the engine reads the trainer's own
memory (in one process, or mapped from another process of the same GPU) instead of a copy.

Reading another's memory needs two orderings, and on CUDA both are kept on the device, with no host wait: the reads
come after the sender's last writes (the reader's stream waits for `ready`, an event the sender recorded after
them), and the sender's next writes come after the reads (the reader records `done` after enqueuing them; the
sender's stream waits for it once the receiver released the transfer). A reader that copies on another device than
the tensors' waits for its copies on the host instead. After `release` nothing may start reading: the sender may be
changing the memory already. The sender keeps the tensors alive until `send` returns; a tensor it drops then must
have been allocated on the stream that waits for `done` (the caller's current stream), whose later work the
allocator orders after the reads.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

from tandem.transport.weights import NamedTensors, validated


def cuda_device(tensors: Mapping[str, Tensor] | list[Tensor]) -> torch.device | None:
    """The tensors' one device if it is a CUDA device; None for another (the CPU) or none. Raises ValueError when
    they are on several devices."""
    devices = {t.device for t in (tensors.values() if isinstance(tensors, Mapping) else tensors)}
    if len(devices) > 1:
        raise ValueError(f"named_tensors: all on one device, got {sorted(map(str, devices))}")
    return devices.pop() if devices and next(iter(devices)).type == "cuda" else None


def record_ready(device: torch.device | None, event: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
    """An event recorded on the caller's current stream of `device` (after its writes); None on the CPU."""
    if device is None:
        return None
    event = event or torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def by_reference(named_tensors: NamedTensors) -> dict[str, Tensor]:
    """The pairs checked (`validated`), no copies: the sender's memory itself (read under no_grad)."""
    return dict(validated(named_tensors))


class Handover(Mapping[str, Tensor]):
    """One transfer's tensors by reference, valid to read only inside `reading` and only until `release`. `device`:
    their CUDA device (None: the CPU). `ready`: recorded by the sender after its last writes; `done`: recorded by
    the reader after its reads (for a sender in another process: an interprocess event it opened)."""

    def __init__(self, tensors: dict[str, Tensor], device: torch.device | None, ready: torch.cuda.Event | None,
                 done: torch.cuda.Event | None = None):
        self.tensors, self.device, self.ready = tensors, device, ready
        self.done = done if done is not None or device is None else torch.cuda.Event()
        self.read = self.released = False
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @contextlib.contextmanager
    def reading(self, reader: torch.device):
        """Read the tensors in the body from the current stream of `reader` (the device the reads write to).
        Raises ValueError when the transfer was released already (a load that outlived its sync)."""
        with self._lock:
            if self.released:
                raise ValueError("weights: the transfer was released before this load read it (the sync it "
                                 "belonged to has ended; the sender may be changing the tensors)")
            same = self.device is not None and reader == self.device
            if same and self.ready is not None:
                torch.cuda.current_stream(reader).wait_event(self.ready)
            elif self.device is not None and self.ready is not None:
                self.ready.synchronize()  # (another device: copies run on both devices' streams)
            try:
                yield
            finally:
                self.read = True
                if same:
                    self.done.record(torch.cuda.current_stream(reader))
                elif self.device is not None:
                    torch.cuda.synchronize(self.device)
                    if reader.type == "cuda":
                        torch.cuda.synchronize(reader)

    def release(self) -> None:
        """No read starts after this (a waiting `reading` finishes enqueuing first)."""
        with self._lock:
            self.released = True

    def wait_read(self) -> None:
        """Make the caller's current stream of the tensors' device wait for the reads (nothing on the CPU, where a
        read is done when `reading` exits). Call after `release`."""
        if self.read and self.device is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done)
