"""The KV transfer by reference between processes of one host, the pool mapped once (`tandem.server.disagg`).

At pairing the decode server maps the prefill server's whole KV pool (`pool_handle` -> `MappedPool`: CUDA IPC on a
GPU, the pool's shared-memory file on a CPU, `KVPool(shared=True)`) and keeps the mapping until it unpairs. For each
request the prefill engine *pins* the pages holding the KV to send (`pin_pages`: a reference in its allocator, so no
page is freed or reused while the transfer is in flight) and takes their checksums: from the records its forward
left as it wrote the KV (`KVPool(slot_sums=True)`, a prefill server's pool: `record_sums_by_index`, a small kernel
over the pages' records), or, for pages the forward did not fill (loaded from the host tier), one pass over the
pages on the device (`page_sums_by_index`); its answer names the pages and their checksums (`PinnedKV.handle`). The
decode engine writes the transfer in one pass too (`MappedKV.write_into`, in its own thread, between steps, gated by
a pause as any import): it reads the mapped pages, writes them into its own pages and checksums what it read, then
compares the checksums with the prefill server's (one host read); on a difference it raises ValueError naming the
first page that differs, and the engine frees the pages it wrote and ends the request (nothing of it is seen). Then
it settles the import (`MappedKV.settle`): its server tells the prefill server, which unpins the pages
(`PinnedKV.free`); if it never does (a decode server that died), the prefill server unpins them after its timeout,
and a decode server that reads them later reads other bytes and fails its checksums: it never keeps them.

The checksums are `kv_transfer.page_sums`'s, computed from the pool by index, no gather buffer
(`tandem.engine.kv_index_sums`): on a GPU by the Triton kernel of `tandem.kernels.kv_copy` (which copies in the same
pass), elsewhere by torch (a gather, the sums, and a scatter).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

from tandem.engine.kv_index_sums import (
    canonical,
    host_sums,
    page_sums_by_index,
    record_sums_by_index,
)
from tandem.engine.kv_pool import KVPool
from tandem.engine.kv_shared import (
    _b64,
    _dtype,
    _gpu_uuid,
    _local_gpu,
    _unb64,
    ipc_describe,
    ipc_open,
    staging,
)
from tandem.engine.kv_transfer import TransferClock, _hex

__all__ = ["MappedKV", "MappedPool", "PinnedKV", "pin_pages", "pool_handle"]


def pool_handle(pool: KVPool) -> dict:
    """What another process of this host needs to map `pool` (JSON): its identity, dtype and shape, and on a GPU its
    keys and values by CUDA IPC (a fresh reference counter each call), on a CPU its shared-memory file; ValueError if
    it cannot be mapped (a CPU pool not built `shared`)."""
    k = pool.k_cache
    handle = {"pool": pool.share_id, "dtype": str(k.dtype).removeprefix("torch."), "shape": list(k.shape),
              "page_size": pool.page_size, "num_pages": pool.num_pages}
    if k.is_cuda:
        with torch.cuda.device(k.device):
            return handle | {"kind": "cuda", "gpu": _gpu_uuid(k.device),
                             "tensors": [ipc_describe(pool.k_cache), ipc_describe(pool.v_cache)]}
    if pool.shm_path is None:
        raise ValueError("kv transfer: this pool is not in shared memory (KVPool(shared=True))")
    return handle | {"kind": "cpu", "path": pool.shm_path}


class MappedPool:
    """A prefill server's KV pool mapped into this process (`pool_handle`'s `handle`): `k`, `v` [L, S, K, D] its own
    memory, read where a transfer names pages of it. ValueError if it cannot be mapped here."""

    def __init__(self, handle: dict, device: torch.device | str):
        try:
            self.id, self.page_size = str(handle["pool"]), int(handle["page_size"])
            self.num_pages, dtype = int(handle["num_pages"]), _dtype(handle)
            shape = [int(n) for n in handle["shape"]]
            if handle["kind"] == "cuda":
                if (index := _local_gpu(handle["gpu"])) is None:
                    raise ValueError(f"the prefill server's GPU {handle['gpu']} is not visible to this process")
                mine = torch.device(device)
                mine = mine.index if mine.type == "cuda" and mine.index is not None else torch.cuda.current_device()
                if mine != index or torch.device(device).type != "cuda":
                    raise ValueError(f"its pool is on GPU {index} of this process, this server's KV on {device}")
                with torch.cuda.device(index):
                    self.k, self.v = (ipc_open(part, dtype, index) for part in handle["tensors"])
            elif handle["kind"] == "cpu":
                path, nbytes = str(handle["path"]), 2 * math.prod(shape) * dtype.itemsize
                if not path.startswith("/proc/") or (size := os.path.getsize(path)) != nbytes:
                    raise ValueError(f"{path} is not a pool of {nbytes} bytes")
                kv = torch.from_file(path, shared=True, size=size, dtype=torch.uint8).view(dtype).view(2, *shape)
                self.k, self.v = kv[0], kv[1]
            else:
                raise ValueError(f"no pool of kind {handle['kind']!r}")
        except (KeyError, ValueError, TypeError, OSError, RuntimeError) as e:
            raise ValueError(f"kv transfer: the prefill server's pool cannot be mapped ({type(e).__name__}: {e})") \
                from None
        if list(self.k.shape) != shape or self.k.dtype != dtype:
            raise ValueError(f"kv transfer: the mapped pool is {tuple(self.k.shape)} {self.k.dtype}, not {shape}")


class PinnedKV:
    """A prefill engine's export by reference: positions [start, end) of a sequence, held in `pages` (one per page
    of `page_size` from `start`) of its pool, pinned until `free`; `sums` their `page_sums` [pages, 2] computed as
    they were pinned (int64 numpy on the host, once the checksum pass is done: reading it waits for the pass;
    `checksums` as `page_checksums` has them; in the handle the pages and the sums are the hex of their
    little-endian bytes: int32 and int64), `routing` ([end - start, layers, k] int16 on the host) where the pool
    keeps it. `head`: what the decode server needs but the sums (JSON, at once), `sums_hex()` the sums (waits for
    the pass; thread-safe; `sums_ready()` says whether it would wait), `handle` both; `unpin(pages)` is called
    once, by `free` or when this is collected. `read_s`: the export's time on the host (pinned, its checksum pass
    queued); `sums_s`: that pass's device time from its launch (with the kernel, on a GPU; else None; known with
    the sums); `pinned_at`: `time.monotonic()` as the pinning began. `staged`: the kept buffer (`Staging`'s,
    with its staging) `sums` is copied into, given back once read, or by `free` (behind the copy)."""

    def __init__(self, pool: KVPool, pages: list[int], start: int, end: int, sums: torch.Tensor,
                 routing: torch.Tensor | None, unpin: Callable[[list[int]], None], read_s: float,
                 clock: TransferClock, pinned_at: float | None = None, staged: tuple | None = None):
        self.pages, self.start, self.end, self.page_size = pages, start, end, pool.page_size
        self.routing, self.read_s, self.pinned_at, self.sums_s = routing, read_s, pinned_at, None
        self._pending, self._clock, self._sums, self._staged = sums, clock, None, staged
        self._lock, self._freed = threading.Lock(), False
        self._unpin = weakref.finalize(self, unpin, pages)  # (an export dropped unfreed unpins as it goes)
        self.pool_id = pool.share_id

    @functools.cached_property
    def head(self) -> dict:
        """(Built when first asked for, by the server's thread: not on the engine's way to the mail.)"""
        head = {"kind": "pages", "pool": self.pool_id, "start": self.start, "end": self.end,
                "page_size": self.page_size, "pages": np.asarray(self.pages, dtype="<i4").tobytes().hex()}
        if self.routing is not None:
            head["routing"] = {"data": _b64(self.routing.contiguous().numpy().tobytes()),
                               "shape": list(self.routing.shape)}
        return head

    @property
    def sums(self) -> np.ndarray:
        if self._sums is None:
            clock = self._clock
            clock.wait("summed")  # (for the pass and the sums' copy to the host)
            if "launch" in clock.host:
                self.sums_s = clock.seconds("launch", "summed")
            with self._lock:
                if self._sums is None:
                    if self._freed and self._staged is None and self._pending is None:
                        raise ValueError("kv transfer: the export was freed before its sums were read")
                    self._sums = canonical(self._pending.numpy())  # (a copy: the buffer is not read again)
                    self._give_back(None)
        return self._sums

    def _give_back(self, after) -> None:
        """The sums' kept buffer back to its staging, free once the device reaches `after` (under `_lock`)."""
        if self._staged is not None:
            stage, buf = self._staged
            self._staged = self._pending = None
            stage.give(buf, after)

    @property
    def pin_parts(self) -> dict:
        """The pinning's host time by part (seconds): from its start to the page index staged, its copy queued,
        the kernels' launch, them queued, the sums' copy queued (marks of `page_sums_by_index` and `pin_pages`;
        those it has)."""
        host, names = self._clock.host, ("pin", "staged", "copied", "launch", "launched", "summed")
        at = [(name, host[name]) for name in names if name in host]
        return {f"{b}_s": tb - ta for (_, ta), (b, tb) in zip(at, at[1:], strict=False)}

    def wait_sums(self) -> None:
        """Wait until `sums` would not wait (thread-safe; reads nothing)."""
        self._clock.wait("summed")

    def sums_ready(self) -> bool:
        """Whether `sums` would not wait (the checksum pass and the sums' copy are done)."""
        return self._sums is not None or self._clock.reached("summed")

    def sums_hex(self) -> str:
        return _sums_hex(self.sums)

    @property
    def handle(self) -> dict:
        return self.head | {"sums": self.sums_hex()}

    @property
    def checksums(self) -> tuple[str, ...]:
        return _hex_pairs(self.sums)

    def free(self, taken: bool) -> None:
        """Unpin the pages (once; `taken` is ignored: the decode server maps the pool, not this export). An export
        nobody frees unpins its pages when it is collected."""
        with self._lock:
            self._freed = True
            self._give_back(self._clock.event("summed"))  # (unread: free once its copy is done)
        self._unpin()


def pin_pages(pool: KVPool, pages: list[int], start: int, end: int,
              unpin: Callable[[list[int]], None]) -> PinnedKV:
    """Pin the pages holding positions [start, end) (`start` page-aligned) of a sequence with page table `pages`
    (a reference each, which `unpin` drops: the engine's thread-safe way back into its allocator) and checksum them
    where they are: from the checksum records the forward left where the pool keeps them and every page is
    `summed` (`record_sums_by_index`: one small kernel), else one pass over the pages on the device; the sums are
    copied to the host behind it (`PinnedKV.sums` waits for them; the host does not wait here). Call in the
    engine's thread, between steps, once the step that computed the KV has been waited for (its sampled tokens
    read): the pages are complete, whoever reads them when."""
    P = pool.page_size
    assert start % P == 0, start
    began, pinned_at = time.perf_counter(), time.monotonic()
    held = list(pages[start // P:-(-end // P)])
    pool.incref(held)
    try:
        clock, staged = TransferClock(pool.k_cache.device), None
        clock.mark("pin", device=False)
        if pool.sums is not None and pool.summed[held].all():  # (recorded as the forward wrote them: no pass)
            sums = record_sums_by_index(pool, held, start, end, clock)
        else:
            sums = page_sums_by_index(pool.k_cache, pool.v_cache, held, start, end, P, clock=clock)
        if sums.is_cuda:  # (into a kept page-locked buffer, behind the pass on this stream; the event says when)
            stage = staging(sums.device)
            buf = stage.take(sums.numel() * 8)
            host = buf.view(sums.numel() * 8, torch.int64).view(sums.shape)
            host.copy_(sums, non_blocking=True)
            sums, staged = host, (stage, buf)
        clock.mark("summed")
        routing = None if pool.routing is None else pool.routing[pool.slots(pages, start, end)].cpu()
    except BaseException:
        pool.decref(held)
        raise
    return PinnedKV(pool, held, start, end, sums, routing, unpin, time.perf_counter() - began, clock, pinned_at,
                    staged)


def _hex_pairs(sums: np.ndarray) -> tuple[str, ...]:
    """`page_sums` [pages, 2] as `page_checksums` gives them."""
    return tuple(_hex(pair) for pair in sums.tolist())


def _sums_hex(sums: np.ndarray) -> str:
    """`page_sums` [pages, 2] (int64 on the host) as the hex of their bytes (little-endian): quick both ways."""
    return np.ascontiguousarray(sums, dtype="<i8").tobytes().hex()


def _sums_of_hex(text: str, pages: int) -> np.ndarray:
    """The inverse of `_sums_hex`, for `pages` pages; ValueError if it is not that."""
    raw = bytes.fromhex(text)
    if len(raw) != 16 * pages:
        raise ValueError(f"{len(raw)} bytes of sums for {pages} pages")
    return np.frombuffer(raw, dtype="<i8").reshape(pages, 2)


class MappedKV:
    """A decode server's import by reference: what a prefill server's `PinnedKV.handle` names in the pool `source`
    maps (positions [start, end), their pages there, checksums, routing), from the prefill server `origin` (named
    in errors), export `export_id`. Nothing is read until the engine writes it (`write_into`), which checks it;
    `verify` checks nothing. A handle may come without the sums (`PinnedKV.head`: the prefill server sends them as
    its checksum pass is done), which `take_sums` gives later; the pass may run before them (`pass_into`), its
    comparison (`check`) not. `settled` is done once the engine wrote it or dropped it (`settle`): its server may
    then release the export. The handle's pages and sums may also be numpy arrays (int32 [pages], int64
    [pages, 2]: a mail's, `tandem.server.disagg_mailbox`)."""

    def __init__(self, source: MappedPool, handle: dict, origin: str = "", export_id: str = ""):
        try:
            if handle["kind"] != "pages" or handle["pool"] != source.id:
                raise ValueError(f"it names pool {handle.get('pool')!r} ({handle['kind']}), the one mapped is "
                                 f"{source.id!r} (the prefill server restarted?)")
            self.start, self.end, self.page_size = int(handle["start"]), int(handle["end"]), int(handle["page_size"])
            pages, sums = handle["pages"], handle.get("sums")
            self.pages = pages if isinstance(pages, np.ndarray) else np.frombuffer(  # (as `PinnedKV.handle`)
                bytes.fromhex(str(pages)), dtype="<i4")
            self.sums = sums if sums is None or isinstance(sums, np.ndarray) else _sums_of_hex(str(sums),
                                                                                               len(self.pages))
            if self.pages.dtype != np.dtype("<i4") or self.sums is not None and (
                    self.sums.shape != (len(self.pages), 2) or self.sums.dtype != np.dtype("<i8")):
                raise ValueError("pages and sums must be int32 [pages] and int64 [pages, 2]")
            self.routing = None
            if (shared := handle.get("routing")) is not None:
                self.routing = torch.frombuffer(bytearray(_unb64(shared["data"])), dtype=torch.int16).view(
                    shared["shape"])
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"kv transfer: the answer is not a KV by reference ({type(e).__name__}: {e})") from None
        n = self.end - self.start
        if (self.page_size != source.page_size or self.start % self.page_size or n < 0
                or len(self.pages) != -(-n // self.page_size)
                or (len(self.pages) and not 0 <= self.pages.min() <= self.pages.max() < source.num_pages)):
            raise ValueError(f"kv transfer: pages {self.pages[:8].tolist()}... do not "
                             f"hold positions [{self.start}, {self.end}) of pool {source.id}")
        self.source, self.origin, self.export_id = source, origin, export_id
        self.clock: TransferClock | None = None
        self.settled: Future = Future()
        self.mine: np.ndarray | None = None  # (the sums of what `pass_into` read)
        self.failure: str | None = None  # (`check`'s difference, once checked)
        self.checked = False
        self.mail: dict | None = None  # (the head of the mail it came by, `disagg_mailbox`; None: by the answer)

    def take_sums(self, text: str) -> None:
        """The prefill server's sums, sent after the handle (the hex of `PinnedKV.sums`' bytes); ValueError if they
        are not this many pages' sums."""
        try:
            self.sums = _sums_of_hex(str(text), len(self.pages))
        except ValueError as e:
            raise ValueError(f"kv transfer: the answer's sums do not parse ({e})") from None

    @property
    def checksums(self) -> tuple[str, ...]:
        """The prefill server's checksums, as `page_checksums` gives them."""
        return _hex_pairs(self.sums)

    @property
    def kv_bytes(self) -> int:
        k = self.source.k
        return 2 * k.shape[0] * (self.end - self.start) * k.shape[2] * k.shape[3] * k.element_size()

    def with_clock(self, clock: TransferClock) -> MappedKV:
        self.clock = clock
        return self

    def verify(self) -> None:
        """Nothing: `write_into` checks what it writes."""

    def settle(self) -> None:
        """The engine is done with this import (written, or dropped): its server may release the export."""
        with contextlib.suppress(Exception):  # (once)
            self.settled.set_result(None)

    def write_into(self, pool: KVPool, pages: list[int]) -> None:
        """Write positions [start, end) into the sequence with page table `pages` in `pool`, in one pass from the
        mapped pages, and check the checksums of what was read against the prefill server's (one host sync):
        `pass_into`, then `check`, raising its ValueError. Call in the engine's thread (or with the pages owned
        otherwise: `EngineCore.write_reserved`)."""
        self.pass_into(pool, pages)
        if self.check() is not None:
            raise ValueError(self.failure)

    def pass_into(self, pool: KVPool, pages: list[int]) -> None:
        """The pass of `write_into`: the pages written and the sums of what was read (`mine`), the host having
        waited for them. ValueError if the routing the pool keeps is missing, or pages are of another size. Marks
        `clock` "write" and "written" around the pass (device events on a GPU; "launch" as its kernels are
        launched), "passed" once the host has its sums."""
        P = self.page_size
        if pool.routing is not None and self.routing is None:
            raise ValueError("kv: the sender kept no routing, which this pool keeps (enable_return_routed_experts)")
        if pool.page_size != P:
            raise ValueError(f"kv transfer: pages of {P} positions, this pool's of {pool.page_size}")
        clock = self.clock = self.clock or TransferClock(pool.k_cache.device)
        clock.mark("write")
        pool.mark_unsummed(pages[self.start // P:-(-self.end // P)])
        sums = page_sums_by_index(self.source.k, self.source.v, self.pages, self.start, self.end, P,
                                  pool.k_cache, pool.v_cache, pages[self.start // P:-(-self.end // P)], clock)
        clock.mark("written")
        if pool.routing is not None:
            pool.routing[pool.slots(pages, self.start, self.end)] = self.routing.to(pool.routing.device)
        self.mine = host_sums(sums)  # (the host waits for the pass)
        clock.mark("passed", device=False)

    def check(self) -> str | None:
        """Compare the sums of what `pass_into` read with the prefill server's (`sums`, which must have come):
        None if they are the same, else (also kept as `failure`) a message naming the first page that differs
        (the pages written then hold bytes nobody may use). Marks `clock` "checked"."""
        if self.mine is None or self.sums is None:
            raise ValueError("kv transfer: checked before its pass ran or before the prefill server's sums came")
        same = np.array_equal(self.mine, self.sums)
        self.checked = True
        if self.clock is not None:
            self.clock.mark("checked", device=False)
        if not same:
            i = int(np.flatnonzero((self.mine != self.sums).any(axis=1))[0])
            self.failure = (f"kv transfer from {self.origin or 'the prefill server'}: page {i} (positions "
                            f"{self.start + i * self.page_size}...) arrived with another checksum than it left with")
        return self.failure
