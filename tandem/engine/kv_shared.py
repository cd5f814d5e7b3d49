"""The KV transfer by reference between processes of one host (`tandem.engine.kv_transfer`'s second way): the
sender's `SharedKV` puts a `KVPages`'s keys and values where the receiver can map them (a GPU's own tensors by CUDA
IPC, a CPU's in a shared-memory file) and describes them in a JSON handle; `open` is the receiver's end (which
`KVPages.from_shared` calls). `sharing_domain` and `why_not_shared` tell a decode server whether it can take a
prefill server's KV this way."""

from __future__ import annotations

import base64
import contextlib
import math
import os
import re
import socket
import tempfile
import uuid
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from tandem.engine.kv_transfer import KVPages

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_SHM_NAME = re.compile(r"tandem-kv-[0-9a-f]{32}")
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


def kv_header(kv: KVPages) -> dict:
    """What describes `kv` but its keys and values, as JSON (`KVPages.from_header` reads it): positions, page size,
    checksums, dtype, shape [L, T, K, D], and the routing itself (small) where there is one."""
    header = {"start": kv.start, "page_size": kv.page_size, "checksums": list(kv.checksums),
              "dtype": str(kv.k.dtype).removeprefix("torch."), "shape": list(kv.k.shape)}
    if kv.routing is not None:
        header["routing"] = {"data": _b64(kv.routing.contiguous().numpy().tobytes()), "shape": list(kv.routing.shape)}
    return header


class SharedKV:
    """The sender's end of a transfer by reference: a `KVPages` where another process of this host can map it,
    described by `handle` (JSON: what `KVPages.from_shared` takes). It holds that memory until `free`. `free(taken)`:
    `taken` if the receiver said it is done (it dropped its mapping), false if it never did (presumed dead): then
    whatever the receiver still counts as mapped is counted off too, or it would never be freed. Build one with
    `SharedKV.of(kv)`; each kind of memory is a subclass, registered in `_WAYS` by `kind`."""

    kind: ClassVar[str]

    def __init__(self, kv: KVPages):
        self.handle = {"kind": self.kind} | kv_header(kv)

    @staticmethod
    def of(kv: KVPages) -> SharedKV:
        """`kv` shared the way its device allows; ValueError if none does."""
        kind = "empty" if kv.k.numel() == 0 else kv.k.device.type
        if kind not in _WAYS:
            raise ValueError(f"transfer: KV on a {kind} device cannot be shared by reference; ask for bytes")
        return _WAYS[kind](kv)

    @staticmethod
    def supports(device: torch.device | str) -> bool:
        return torch.device(device).type in _WAYS

    def free(self, taken: bool) -> None:
        raise NotImplementedError

    @classmethod
    def open(cls, handle: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The receiver's end: copies on `device` of the keys and values `handle` describes, the mapping dropped."""
        raise NotImplementedError


class _EmptyKV(SharedKV):
    """No positions (the decode server held every page): nothing to map."""

    kind = "empty"

    def free(self, taken: bool) -> None:
        pass

    @classmethod
    def open(cls, handle, device):
        shape = _shape(handle)
        if math.prod(shape):
            raise ValueError(f"an empty handle of shape {shape}")
        k = torch.empty(shape, dtype=_dtype(handle), device=device)
        return k, k.clone()


class _ShmKV(SharedKV):
    """On a CPU: keys then values copied into a file of their own in `SHM_DIR` (shared memory), removed by
    `free`. Mapping a file that is gone fails; one removed while mapped stays readable until unmapped."""

    kind = "cpu"

    def __init__(self, kv: KVPages):
        super().__init__(kv)
        name = f"tandem-kv-{uuid.uuid4().hex}"
        self.path, nbytes = os.path.join(SHM_DIR, name), _nbytes(self.handle)
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        try:
            os.truncate(self.path, nbytes)
            kv_2LTKD = _as_kv(torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8), self.handle)
            kv_2LTKD[0].copy_(kv.k)
            kv_2LTKD[1].copy_(kv.v)
        except BaseException:
            self.free(taken=False)
            raise
        self.handle["name"] = name

    def free(self, taken: bool) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    @classmethod
    def open(cls, handle, device):
        name = handle["name"]
        if not isinstance(name, str) or not _SHM_NAME.fullmatch(name):
            raise ValueError(f"not a shared KV file: {name!r}")
        path, nbytes = os.path.join(SHM_DIR, name), _nbytes(handle)
        if (size := os.path.getsize(path)) != nbytes:  # (a shorter file would fault when read past its end)
            raise ValueError(f"{path} holds {size} bytes, the handle {nbytes}")
        kv_2LTKD = _as_kv(torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8), handle).to(
            device, copy=True)
        return kv_2LTKD[0], kv_2LTKD[1]


class _CudaKV(SharedKV):
    """On a GPU: the KV's own device tensors, by CUDA IPC (torch.multiprocessing's reductions, their arguments
    sent as JSON: nothing is unpickled). torch counts the receiver's mappings in shared memory and keeps a tensor
    whose count is not zero after this process drops it (its "limbo"); the receiver counts its mapping off when it
    drops it. A receiver that died never does: `free(taken=False)` counts it off for it."""

    kind = "cuda"

    def __init__(self, kv: KVPages):
        super().__init__(kv)
        self._tensors = [kv.k, kv.v]  # alive here until freed: the receiver maps this memory
        parts = [ipc_describe(t) for t in self._tensors]
        self._counters = [(_unb64(p["ref_counter"]), p["ref_counter_offset"]) for p in parts]
        self.handle |= {"gpu": _gpu_uuid(kv.k.device), "tensors": parts}

    def free(self, taken: bool) -> None:
        if not taken and self._tensors:
            for counter, offset in self._counters:
                torch.UntypedStorage._release_ipc_counter(counter, offset, device=self._tensors[0].device)
        self._tensors = []

    @classmethod
    def open(cls, handle, device):
        dtype, parts, index = _dtype(handle), handle["tensors"], _local_gpu(handle["gpu"])
        remotes = []
        try:
            if index is None:
                raise ValueError(f"the sender's GPU {handle['gpu']} is not visible to this process")
            if len(parts) != 2:
                raise ValueError(f"a handle of {len(parts)} tensors, not keys and values")
            with transfer_stream(device) as stream:  # (the sender's event is waited for on it, as the copies are)
                for part in parts:
                    remotes.append(ipc_open(part, dtype, index))
                kv_2LTKD = torch.empty((2, *remotes[0].shape), dtype=dtype, device=device)
                for i, remote in enumerate(remotes):
                    kv_2LTKD[i].copy_(remote)  # (device to device: the host does not wait)
                stream.synchronize()  # the copies have finished before the mappings go
        finally:
            for part in parts[len(remotes):]:  # never mapped: count them off, or the sender's torch keeps them
                with contextlib.suppress(Exception):  # (it fails only if the sender's counters are gone with it)
                    torch.UntypedStorage._release_ipc_counter(_unb64(part["ref_counter"]),
                                                              int(part["ref_counter_offset"]), device=device)
            remotes.clear()  # (dropping the mappings counts them off, now, not with a traceback that holds them)
        return kv_2LTKD[0], kv_2LTKD[1]


_WAYS: dict[str, type[SharedKV]] = {w.kind: w for w in (_EmptyKV, _ShmKV, _CudaKV)}


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


def _shape(handle: dict) -> list[int]:
    shape = [int(n) for n in handle["shape"]]
    if len(shape) != 4 or min(shape) < 0:
        raise ValueError(f"not a KV shape [L, T, K, D]: {shape}")
    return shape


def _nbytes(handle: dict) -> int:
    """The bytes of keys and values together."""
    return 2 * math.prod(_shape(handle)) * _dtype(handle).itemsize


def _as_kv(raw: torch.Tensor, handle: dict) -> torch.Tensor:
    """Bytes `raw` seen as keys and values [2, L, T, K, D]."""
    return raw.view(_dtype(handle)).view(2, *_shape(handle))


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)
