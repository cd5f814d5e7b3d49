"""What the KV transfers between processes of one host share (`tandem.engine.kv_transfer`, `kv_mapped`, `kv_p2p`):
a CUDA tensor described as JSON and mapped by another process (`ipc_describe`, `ipc_open`: how a decode server
maps a prefill server's pool), a KV's header (`kv_header`), the receiver's transfer stream, host buffers kept for
the transfers' small copies between host and device (`Staging`), and `sharing_domain` / `why_not_shared`, which tell
a decode server whether it can take a prefill server's KV by reference."""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import threading
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.engine.kv_transfer import KVPages

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def transfer_stream(device: torch.device | str):
    """Where a receiver's transfer work runs (its copies, receives and checksums), yielding the stream or None: on
    a GPU a stream of this process's own for transfers, which does not wait for the engine's steps on its compute
    stream (so a host that waits for a transfer waits for it alone); elsewhere nothing changes. What is allocated
    on it and read later on another stream must be recorded there (`write_pages` does)."""
    device = torch.device(device)
    if device.type != "cuda":
        yield None
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _STREAMS.get(device) or _STREAMS.setdefault(device, torch.cuda.Stream(device))
    with torch.cuda.stream(stream):
        yield stream


@dataclass(eq=False)
class StagingBuffer:
    """A host buffer of `Staging` (`data`: uint8, page-locked where the staging is); `done`: what its staging waits
    for before handing it out again (an event behind the last copy that read or wrote it; None: nothing)."""

    data: torch.Tensor
    done: object = field(default=None)
    _event: object = field(default=None)

    def view(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """Its first `nbytes` bytes as `dtype` (1-d)."""
        return self.data[:nbytes].view(dtype)

    def record(self, device: torch.device):
        """An event of this buffer's own (made once) recorded on `device`'s current stream, behind the copy just
        queued there: what `Staging.give` then waits for. None off a GPU (the copies there are synchronous)."""
        if device.type != "cuda":
            return None
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(device))
        return self._event


class Staging:
    """Host buffers for a transfer's small copies between host and device (page indices up, sums down), kept and
    reused instead of allocated per transfer: a page-locked allocation (`pin`) may synchronise the device, and
    copies from pageable memory are staged by the driver. `take(nbytes)` hands out a buffer nobody uses (at least
    `nbytes`; a new one if none is free), `give(buffer, after)` takes it back: it is handed out again only once the
    device has reached `after` (an event recorded behind the last copy that reads or writes it; None: at once).
    Thread-safe; at most `keep` free buffers the device is past are kept (more are dropped). A buffer the device may
    still read or write is never dropped: freed, its page-locked memory could be handed to another allocation at once
    (torch tracks no kernel's reads of it), as a pass queued behind a doorbell (`doorbell`) reads its page index only
    when the bell rings."""

    def __init__(self, pin: bool, keep: int = 8):
        self.pin, self.keep = pin, keep
        self._free: list[StagingBuffer] = []
        self._lock = threading.Lock()
        self.allocated = 0  # (buffers made: a test's way to see reuse)

    def take(self, nbytes: int) -> StagingBuffer:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.data.numel() >= nbytes and (buf.done is None or buf.done.query()):
                    return self._free.pop(i)
            self.allocated += 1
        size = max(4096, 1 << (max(nbytes, 1) - 1).bit_length())  # (a power of 2: reused by other sizes)
        return StagingBuffer(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))

    def give(self, buf: StagingBuffer, after=None) -> None:
        buf.done = after
        with self._lock:
            self._free.append(buf)
            past = [b for b in self._free if b.done is None or b.done.query()]
            for b in past[:max(0, len(past) - self.keep)]:
                self._free.remove(b)


_STAGING: dict[torch.device, Staging] = {}


def staging(device: torch.device | str) -> Staging:
    """The process's `Staging` for copies to and from `device` (page-locked on a GPU; one a GPU, as the events its
    buffers carry are that GPU's)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _STAGING.get(device) or _STAGING.setdefault(device, Staging(pin=device.type == "cuda"))


def kv_header(kv: KVPages) -> dict:
    """What describes `kv` but its keys and values, as JSON (`KVPages.from_header` reads it): positions, page size,
    checksums, dtype, shape [L, T, K, D], and the routing itself (small) where there is one."""
    header = {"start": kv.start, "page_size": kv.page_size, "checksums": list(kv.checksums),
              "dtype": str(kv.k.dtype).removeprefix("torch."), "shape": list(kv.k.shape)}
    if kv.routing is not None:
        header["routing"] = {"data": _b64(kv.routing.contiguous().numpy().tobytes()), "shape": list(kv.routing.shape)}
    return header


def ipc_describe(t: torch.Tensor) -> dict:
    """A CUDA tensor of this process as JSON that another process of the host maps (`ipc_open`): torch's CUDA IPC
    reduction (`torch.multiprocessing.reductions`), its arguments as JSON, so nothing is unpickled. Each call takes
    a reference counter of its own, which the mapping process counts off when it drops its mapping."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, (_, size, stride, offset, _, _, _, handle, storage_bytes, storage_offset, _, counter, counter_offset,
        event, event_sync) = reduce_tensor(t)
    return {"size": list(size), "stride": list(stride), "offset": offset, "handle": _b64(handle),
            "storage_bytes": storage_bytes, "storage_offset": storage_offset, "ref_counter": _b64(counter),
            "ref_counter_offset": counter_offset, "event": _b64(event), "event_sync": bool(event_sync)}


def ipc_open(part: dict, dtype: torch.dtype, index: int) -> torch.Tensor:
    """The tensor `ipc_describe` described, mapped into this process on GPU `index` (its memory, not a copy)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(part["size"]), tuple(part["stride"]), int(part["offset"]), torch.UntypedStorage,
        dtype, index, _unb64(part["handle"]), int(part["storage_bytes"]), int(part["storage_offset"]), False,
        _unb64(part["ref_counter"]), int(part["ref_counter_offset"]), _unb64(part["event"]),
        bool(part["event_sync"]))


def sharing_domain(device: torch.device | str) -> dict:
    """What a receiver compares with its own to know whether it can map this process's KV on `device`
    (`why_not_shared`): the host, this process, the device type, and a GPU's UUID."""
    device = torch.device(device)
    return {"host": _host_id(), "process": f"{os.getpid()}-{_PROCESS}", "device": device.type,
            "gpu": _gpu_uuid(device) if device.type == "cuda" else None}


def why_not_shared(theirs: dict, device: torch.device | str) -> str | None:
    """Why this process cannot take into `device`, by reference, KV from a process whose `sharing_domain` is
    `theirs`; None if it can."""
    device, mine = torch.device(device), sharing_domain("cpu")
    if theirs.get("host") != mine["host"]:
        return f"it runs on another host ({theirs.get('host')}; this one is {mine['host']})"
    if theirs.get("device") != device.type:
        return f"its KV is on a {theirs.get('device')} device, this server's on a {device.type} device"
    if device.type == "cuda" and theirs.get("process") == mine["process"]:
        return "it is this very process (CUDA IPC cannot map a process's own memory)"
    if device.type == "cuda" and _local_gpu(theirs.get("gpu")) is None:
        return f"its GPU {theirs.get('gpu')} is not visible to this process"
    return None


_PROCESS = uuid.uuid4().hex  # (with the pid: a forked child is another process)


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:  # (a host name alone may repeat across machines)
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _local_gpu(gpu_uuid) -> int | None:
    """This process's index of the GPU with UUID `gpu_uuid` (visible devices are numbered per process)."""
    if not torch.cuda.is_available():
        return None
    return next((i for i in range(torch.cuda.device_count()) if _gpu_uuid(torch.device("cuda", i)) == gpu_uuid),
                None)


def _dtype(handle: dict) -> torch.dtype:
    dtype = getattr(torch, str(handle["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {handle['dtype']!r}")
    return dtype


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)
