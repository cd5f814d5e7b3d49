"""Doorbells: words of shared host memory that a GPU stream waits on, rung by another process of the host.

A decode server queues a KV transfer's pass behind a wait on a doorbell as soon as it knows the pages (the pages
mail, while the prefill server still computes them), and the prefill engine rings the doorbell once the KV is
complete, so the device starts the pass then, with no host of this side on the way (`EngineCore.arm_reserved`).

`Doorbells` (the waiting side) holds `SLOTS` 32-bit words in a shared-memory file (`kv_pool._shared_memory`),
registered with the CUDA driver; `take()` hands out a `Bell` (a free word, a fresh ticket, and a stream of the word's
own), `Bell.wait()` queues on its stream a wait until the word holds the ticket (`cuStreamWaitValue32`: the GPU's
front end waits, no kernel spins), and `Bell.ring()` stores the ticket from this process. The ringing side names a
bell by `spec` (the file, word and ticket) and rings it with `ring(spec)`. Tickets are never reused, so a ring late
for an earlier user of the word releases nothing of a later one's (whose own wait still needs its ticket). A wait
released by nobody would stall its stream: its owner rings its own bell before giving it up (`Bell.ring`). CUDA only;
where the driver refuses stream waits on host memory, `Doorbells.open` gives None and transfers take the host's
way. A queued wait holds what its stream's hardware queue holds: streams beyond the device's queues
(`CUDA_DEVICE_MAX_CONNECTIONS`) share one, so it may hold other streams' work until it is rung. While one is queued,
a host call of this process that synchronises the device or loads a kernel (a first launch under lazy loading, a
new Triton kernel, `empty_cache`) waits until it is rung; a bell lent with a deadline (`Doorbells.take`) is rung by a
watchdog thread at the latest then, so no such wait is for ever."""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger("tandem.engine.doorbell")

__all__ = ["MAGIC", "SLOTS", "Bell", "Doorbells", "ring"]

SLOTS = 1024  # words of one doorbells file; the first holds MAGIC, the others are bells
MAGIC = 0x6C656264  # (a ringer writes only into a file that starts with it)
_WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ
_REGISTER_PORTABLE_DEVICEMAP = 0x1 | 0x2  # CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP


@dataclass(eq=False)
class Bell:
    """One doorbell lent out: word `slot` of the file at `path`, to be rung with `ticket`."""

    path: str
    slot: int
    ticket: int
    word: np.ndarray  # a uint32 view of the word, here
    owner: Doorbells
    stream: torch.cuda.ExternalStream  # the word's own stream: nothing but its owner's work waits there

    @property
    def spec(self) -> str:
        """What the ringing process needs (`ring`)."""
        return f"{self.path}:{self.slot}:{self.ticket}"

    def ring(self) -> None:
        self.word[0] = self.ticket

    def wait(self) -> None:
        """Queue on its stream a wait until this bell is rung."""
        self.owner._wait(self)

    def give_back(self) -> None:
        """To its doorbells (once rung and its stream past the wait, or if no wait on it was queued)."""
        self.owner._give(self.slot)

    def __repr__(self) -> str:
        return f"Bell({self.spec})"


class Doorbells:
    """A process's doorbells on one GPU (see the module docstring); `open(device)` makes them."""

    def __init__(self, path: str, words: torch.Tensor, device_ptr: int, cuda, device: torch.device, context):
        self.device, self._context = device, context
        self.path, self._words, self._base, self._cuda = path, words.numpy().view(np.uint32), device_ptr, cuda
        self._words[0] = MAGIC
        self._free = list(range(SLOTS - 1, 0, -1))
        self._streams: dict[int, torch.cuda.ExternalStream] = {}
        self._tickets = itertools.count(1)
        self._lock = threading.Lock()
        self._deadlines: dict[int, tuple[float, Bell]] = {}  # slot -> (time.monotonic() deadline, the bell lent)
        self._watchdog: threading.Thread | None = None

    @classmethod
    def open(cls, device: torch.device) -> Doorbells | None:
        """This process's doorbells for streams of `device` (a GPU), or None (logged) where this driver or host
        cannot have them. Made once a device and kept for the process's life (their memory stays registered with
        the driver: a file unmapped while registered would leave its addresses refused to the next one)."""
        if device.type != "cuda":
            return None
        index = torch.cuda.current_device() if device.index is None else device.index
        with _OPENING:
            if index not in _OPENED:
                _OPENED[index] = cls._make(torch.device("cuda", index))
            return _OPENED[index]

    @classmethod
    def _make(cls, device: torch.device) -> Doorbells | None:
        from tandem.engine.kv_pool import _shared_memory

        try:
            cuda = ctypes.CDLL("libcuda.so.1")
            _check(cuda.cuInit(ctypes.c_uint(0)), "cuInit")
            if (shm := _shared_memory(4 * SLOTS, "doorbells")) is None:
                return None
            path, words = shm
            context = ctypes.c_void_p()  # (the runtime's: torch's tensors and streams live there)
            _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), ctypes.c_int(device.index)),
                   "cuDevicePrimaryCtxRetain")
            _check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
            ptr = ctypes.c_void_p(words.data_ptr())
            _check(cuda.cuMemHostRegister_v2(ptr, ctypes.c_size_t(4 * SLOTS),
                                             ctypes.c_uint(_REGISTER_PORTABLE_DEVICEMAP)), "cuMemHostRegister")
            dptr = ctypes.c_uint64()
            _check(cuda.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ptr, ctypes.c_uint(0)),
                   "cuMemHostGetDevicePointer")
            bells = cls(path, words, dptr.value, cuda, device, context)
            bells._smoke(device)
            return bells
        except (OSError, RuntimeError, AttributeError) as e:
            log.warning("doorbells: none on %s (%s); KV transfers take the host's way", device, e)
            return None

    def take(self, deadline_s: float | None = None) -> Bell | None:
        """A free word with a fresh ticket (the word cleared), or None if all are lent (or its stream cannot be
        made). `deadline_s`: if it is still lent that many seconds from now, a watchdog thread rings it (logged).
        That bounds every stall a wait nobody rings could cause: also this process's own, since while a wait is
        queued any host call that synchronises the device or loads a kernel (a first launch under lazy loading, a
        Triton kernel, `empty_cache`) waits for the ring, and may be the very thread that was to ring it."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            ticket = next(self._tickets) & 0xFFFFFFFF or next(self._tickets)
        word = self._words[slot:slot + 1]
        word[0] = 0
        if (stream := self._streams.get(slot)) is None:
            try:
                stream = self._streams[slot] = self._new_stream()
            except RuntimeError as e:  # (never a request's failure: its transfer takes the host's way)
                log.warning("doorbells: no stream for a bell (%s); this transfer takes the host's way", e)
                self._give(slot)
                return None
        bell = Bell(self.path, slot, ticket, word, self, stream)
        if deadline_s is not None:
            with self._lock:
                self._deadlines[slot] = (time.monotonic() + deadline_s, bell)
                if self._watchdog is None:
                    self._watchdog = threading.Thread(target=self._watch, name="doorbells-watchdog", daemon=True)
                    self._watchdog.start()
        return bell

    def _new_stream(self) -> torch.cuda.ExternalStream:
        """A stream of its own (not one of torch's pooled streams, which other work may share), not synchronising
        with the legacy default stream."""
        handle = ctypes.c_void_p()
        self._current()
        _check(self._cuda.cuStreamCreate(ctypes.byref(handle), ctypes.c_uint(0x1)), "cuStreamCreate")  # NON_BLOCKING
        return torch.cuda.ExternalStream(handle.value, device=self.device)

    def _give(self, slot: int) -> None:
        with self._lock:
            self._deadlines.pop(slot, None)
            self._free.append(slot)

    def _watch(self, every_s: float = 0.5) -> None:
        """(The watchdog's thread) ring each lent bell past its deadline, once."""
        while True:
            time.sleep(every_s)
            now = time.monotonic()
            with self._lock:  # (under the lock: a bell given back, its word lent again, is no longer here)
                for slot, (deadline, bell) in list(self._deadlines.items()):
                    if now >= deadline:
                        del self._deadlines[slot]
                        bell.ring()
                        log.warning("doorbells: %s rung by its deadline (nobody else rang it in time)", bell)

    def _wait(self, bell: Bell) -> None:
        self._current()
        _check(self._cuda.cuStreamWaitValue32_v2(ctypes.c_void_p(bell.stream.cuda_stream),
                                                  ctypes.c_uint64(self._base + 4 * bell.slot),
                                                  ctypes.c_uint32(bell.ticket), ctypes.c_uint(_WAIT_EQ)),
               "cuStreamWaitValue32")

    def _current(self) -> None:
        """The driver's calls act on the calling thread's current context: make it the device's primary one (the
        runtime's, which a thread that made no runtime call yet does not have)."""
        _check(self._cuda.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    def _smoke(self, device: torch.device) -> None:
        """RuntimeError unless a queued wait holds its stream until its bell rings, then lets it go."""
        if (bell := self.take()) is None:
            raise RuntimeError("no stream for a bell")
        done = torch.cuda.Event()
        try:
            bell.wait()
            done.record(bell.stream)
            time.sleep(0.01)
            if done.query():
                raise RuntimeError("a stream did not wait for its doorbell")
            bell.ring()
            deadline = time.monotonic() + 5
            while not done.query():
                if time.monotonic() > deadline:
                    raise RuntimeError("a rung doorbell did not release its stream")
                time.sleep(0.001)
        finally:
            bell.give_back()


_OPENED: dict[int, Doorbells | None] = {}  # device index -> this process's doorbells (`Doorbells.open`)
_OPENING = threading.Lock()


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed (CUDA driver error {result})")


_RUNG: dict[str, np.ndarray] = {}  # file -> its words mapped here (the ringing side)
_RUNG_LOCK = threading.Lock()


def ring(spec: str) -> None:
    """Ring the bell `spec` names (`Bell.spec`: another process's doorbells file, a word of it, the ticket).
    ValueError naming what is wrong if it names no word of a doorbells file."""
    from tandem.engine.kv_mapped import _map_file

    try:
        path, slot, ticket = spec.rsplit(":", 2)
        slot, ticket = int(slot), int(ticket)
    except ValueError:
        raise ValueError(f"doorbell {spec!r}: not FILE:WORD:TICKET") from None
    if not 0 < slot < SLOTS or not 0 < ticket <= 0xFFFFFFFF:
        raise ValueError(f"doorbell {spec!r}: word {slot} or ticket {ticket} out of range")
    with _RUNG_LOCK:
        if (words := _RUNG.get(path)) is None:
            try:
                words = _map_file(path, 4 * SLOTS).numpy().view(np.uint32)
            except (OSError, RuntimeError) as e:
                raise ValueError(f"doorbell {spec!r}: {e}") from None
            if words[0] != MAGIC:
                raise ValueError(f"doorbell {spec!r}: {path} is no doorbells file")
            _RUNG[path] = words
    words[slot] = ticket
