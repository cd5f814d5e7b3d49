"""KV pages between a prefill server and a decode server (prefill/decode disaggregation).

A prefill server computes a prompt's KV and its first token; the decode server takes the KV of the positions it
does not hold yet and decodes from there. What moves is a `KVPages`: the keys and values of token positions
[start, end) of one sequence, every layer, with a checksum per page computed where they were read, so the receiver
can prove it writes what the sender read. It moves in one of two ways (the servers choose: `tandem.server.disagg`):

- bytes, between any two processes: `to_bytes` / `from_bytes` (safetensors: dtype and shapes travel with the data).
  The receiver owns what it parsed.
- by reference, between processes of one host: the sender's `SharedKV` puts the KV where the receiver can map it
  (on a GPU its own device tensors, by CUDA IPC; on a CPU a file in shared memory) and describes it in a JSON
  `handle`; the receiver's `KVPages.from_shared(handle, device)` maps it, copies it onto `device` and drops the
  mapping before it returns. The sender keeps the memory until the receiver says it is done, then `free`s it; if
  the receiver never says so (it died) the sender frees it after a timeout of its own choosing, and a receiver
  that maps it later fails, or reads other bytes and fails its checksums: it never writes them.

Either way the receiver verifies the checksums of what it holds (`verify`) before it writes anything.

`read_pages` and `write_pages` are the two ends in a KV pool. Both run in the engine's thread, between steps, so no
page is freed or reused while its content is on the way in or out: `read_pages` copies the pages before the
request that holds them lets them go.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import re
import socket
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from tandem.engine.kv_pool import KVPool

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_SHM_NAME = re.compile(r"tandem-kv-[0-9a-f]{32}")


@dataclass(frozen=True)
class KVPages:
    """Keys and values [L, end - start, K, D] of positions [start, end); `checksums`: one per page of `page_size`
    positions from `start` (page-aligned), over both tensors' bits (`page_checksums`). `routing`: the positions'
    routed experts [end - start, layers, k] int16 on the host, where the sender's pool keeps them
    (`KVPool.routing`; small, so it always travels in the message itself). Immutable: `verify` checks once."""

    start: int
    k: torch.Tensor
    v: torch.Tensor
    page_size: int
    checksums: tuple[str, ...]
    routing: torch.Tensor | None = None
    _verified: bool = field(default=False, init=False, repr=False, compare=False)

    @property
    def end(self) -> int:
        return self.start + self.k.shape[1]

    def to_bytes(self) -> bytes:
        k, v = self.k.cpu(), self.v.cpu()
        meta = {"start": str(self.start), "page_size": str(self.page_size), "checksums": json.dumps(self.checksums)}
        routing = {} if self.routing is None else {"routing": self.routing.contiguous()}
        return save_tensors({"k": k.contiguous(), "v": v.contiguous(), **routing}, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes, meta: dict) -> KVPages:
        """The inverse of `to_bytes`, with the metadata `meta` (see `wire_meta`); ValueError if it does not parse."""
        try:
            tensors = load_tensors(data)
            return cls(int(meta["start"]), tensors["k"], tensors["v"], int(meta["page_size"]),
                       tuple(json.loads(meta["checksums"])), tensors.get("routing"))
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"kv transfer: the payload does not parse ({e})") from e

    @classmethod
    def from_shared(cls, handle: dict, device: torch.device | str) -> KVPages:
        """A copy on `device` of the KV that another process's `SharedKV` describes (`handle`). The mapping is
        dropped before this returns (on a GPU, once the copy has finished), so the sender may then free it; not
        verified yet. ValueError if the handle does not parse or its memory cannot be mapped here."""
        try:
            k, v = _WAYS[handle["kind"]].open(handle, torch.device(device))
            routing = None
            if (shared := handle.get("routing")) is not None:
                routing = torch.frombuffer(bytearray(_unb64(shared["data"])), dtype=torch.int16).view(shared["shape"])
            return cls(int(handle["start"]), k, v, int(handle["page_size"]), tuple(map(str, handle["checksums"])),
                       routing)
        except (KeyError, ValueError, TypeError, OSError, RuntimeError) as e:
            raise ValueError(f"kv transfer: the shared KV cannot be taken ({type(e).__name__}: {e})") from e

    def verify(self) -> None:
        """Raise ValueError naming the first page whose checksum differs from the sender's."""
        if self._verified:
            return
        mine = page_checksums(self.k, self.v, self.page_size)
        if len(mine) != len(self.checksums):
            raise ValueError(f"kv transfer: {len(mine)} pages arrived, the sender sent {len(self.checksums)}")
        for i, (a, b) in enumerate(zip(mine, self.checksums, strict=True)):
            if a != b:
                raise ValueError(f"kv transfer: page {i} (positions {self.start + i * self.page_size}...) arrived "
                                 "with another checksum than it left with")
        object.__setattr__(self, "_verified", True)


def wire_meta(data: bytes) -> dict:
    """The metadata of `KVPages.to_bytes`'s output (safetensors' header)."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + size]).get("__metadata__", {})


CHECKSUM_CHUNK = 256  # positions at a time: the checksum's int64 words stay a small multiple of the KV


def page_checksums(k: torch.Tensor, v: torch.Tensor, page_size: int) -> tuple[str, ...]:
    """A 64-bit checksum per page of positions (dimension 1) of 2- or 4-byte keys and values, computed where they
    are (no copy to the host: a GPU sums its own memory at its bandwidth): each 16-bit word of a position times an
    odd weight of its place, the position's sum times an odd weight of its offset in the page, summed per page.
    Integer arithmetic modulo 2**64, so every device gives the same value; any change to one word changes it."""
    n = k.shape[1]
    sums = torch.zeros(-(-n // page_size), dtype=torch.int64, device=k.device)
    for s in range(0, n, CHECKSUM_CHUNK):
        words = torch.cat([k[:, s:s + CHECKSUM_CHUNK], v[:, s:s + CHECKSUM_CHUNK]]).transpose(0, 1).contiguous()
        words = words.view(torch.int16).reshape(words.shape[0], -1).long()  # [positions, words]
        weights = torch.arange(words.shape[1], device=k.device) * 0x9E3779B1 % (1 << 31) * 2 + 1
        at = torch.arange(s, s + words.shape[0], device=k.device)
        per_position = (words * weights).sum(dim=1) * ((at % page_size) * 2 + 1)
        sums.index_add_(0, at // page_size, per_position)
    return tuple(f"{x & 0xFFFFFFFFFFFFFFFF:016x}" for x in sums.tolist())


def read_pages(pool: KVPool, pages: list[int], start: int, end: int,
               device: torch.device | str = "cpu") -> KVPages:
    """A copy on `device` of positions [start, end) of a sequence with page table `pages` (`start` page-aligned):
    on the host for the bytes transfer, on the pool's own device for a transfer by reference (`SharedKV`); its
    checksums are of that copy."""
    assert start % pool.page_size == 0, start
    slots = pool.slots(pages, start, end)
    k, v = pool.k_cache[:, slots].to(device), pool.v_cache[:, slots].to(device)  # (indexing copies)
    routing = None if pool.routing is None else pool.routing[slots].cpu()
    return KVPages(start, k, v, pool.page_size, page_checksums(k, v, pool.page_size), routing)


def write_pages(pool: KVPool, pages: list[int], kv: KVPages) -> None:
    """Write `kv` into positions [kv.start, kv.end) of a sequence with page table `pages` (its routing too, where
    the pool keeps it: ValueError if the pool keeps it and `kv` lacks it)."""
    slots = pool.slots(pages, kv.start, kv.end)
    if pool.routing is not None and kv.routing is None:
        raise ValueError("kv: the sender kept no routing, which this pool keeps (enable_return_routed_experts)")
    pool.k_cache[:, slots] = kv.k.to(pool.k_cache.device, pool.k_cache.dtype)
    pool.v_cache[:, slots] = kv.v.to(pool.v_cache.device, pool.v_cache.dtype)
    if pool.routing is not None:
        pool.routing[slots] = kv.routing.to(pool.routing.device)


# ---- the transfer by reference ------------------------------------------------------------------------------
class SharedKV:
    """The sender's end of a transfer by reference: a `KVPages` where another process of this host can map it,
    described by `handle` (JSON: what `KVPages.from_shared` takes). It holds that memory until `free`. `free(taken)`:
    `taken` if the receiver said it is done (it dropped its mapping), false if it never did (presumed dead): then
    whatever the receiver still counts as mapped is counted off too, or it would never be freed. Build one with
    `SharedKV.of(kv)`; each kind of memory is a subclass, registered in `_WAYS` by `kind`."""

    kind: ClassVar[str]

    def __init__(self, kv: KVPages):
        self.handle = {"kind": self.kind, "start": kv.start, "page_size": kv.page_size,
                       "checksums": list(kv.checksums), "dtype": str(kv.k.dtype).removeprefix("torch."),
                       "shape": list(kv.k.shape)}
        if kv.routing is not None:
            self.handle["routing"] = {"data": _b64(kv.routing.contiguous().numpy().tobytes()),
                                      "shape": list(kv.routing.shape)}

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
        from torch.multiprocessing.reductions import reduce_tensor

        super().__init__(kv)
        self._tensors = [kv.k, kv.v]  # alive here until freed: the receiver maps this memory
        self._counters: list[tuple[bytes, int]] = []
        parts = []
        for t in self._tensors:
            _, (_, size, stride, offset, _, _, _, handle, storage_bytes, storage_offset, _, counter, counter_offset,
                event, event_sync) = reduce_tensor(t)
            self._counters.append((counter, counter_offset))
            parts.append({"size": list(size), "stride": list(stride), "offset": offset, "handle": _b64(handle),
                          "storage_bytes": storage_bytes, "storage_offset": storage_offset,
                          "ref_counter": _b64(counter), "ref_counter_offset": counter_offset, "event": _b64(event),
                          "event_sync": bool(event_sync)})
        self.handle |= {"gpu": _gpu_uuid(kv.k.device), "tensors": parts}

    def free(self, taken: bool) -> None:
        if not taken and self._tensors:
            for counter, offset in self._counters:
                torch.UntypedStorage._release_ipc_counter(counter, offset, device=self._tensors[0].device)
        self._tensors = []

    @classmethod
    def open(cls, handle, device):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        dtype, parts, index = _dtype(handle), handle["tensors"], _local_gpu(handle["gpu"])
        copies, mapped = [], 0
        try:
            if index is None:
                raise ValueError(f"the sender's GPU {handle['gpu']} is not visible to this process")
            for part in parts:
                remote = rebuild_cuda_tensor(
                    torch.Tensor, torch.Size(part["size"]), tuple(part["stride"]), int(part["offset"]),
                    torch.UntypedStorage, dtype, index, _unb64(part["handle"]), int(part["storage_bytes"]),
                    int(part["storage_offset"]), False, _unb64(part["ref_counter"]), int(part["ref_counter_offset"]),
                    _unb64(part["event"]), bool(part["event_sync"]))
                mapped += 1
                try:
                    copies.append(remote.to(device, copy=True))
                    torch.cuda.synchronize(device)  # the copy has finished before the mapping goes
                finally:
                    del remote  # (dropping the mapping counts it off, now, not with a traceback that holds it)
        finally:
            for part in parts[mapped:]:  # never mapped: count them off, or the sender's torch keeps them
                with contextlib.suppress(Exception):  # (it fails only if the sender's counters are gone with it)
                    torch.UntypedStorage._release_ipc_counter(_unb64(part["ref_counter"]),
                                                              int(part["ref_counter_offset"]), device=device)
        k, v = copies
        return k, v


_WAYS: dict[str, type[SharedKV]] = {w.kind: w for w in (_EmptyKV, _ShmKV, _CudaKV)}


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
