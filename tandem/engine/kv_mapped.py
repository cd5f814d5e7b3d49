"""The KV transfer by reference between processes of one host, the pool mapped once (`tandem.server.disagg`).

At pairing the decode server maps the prefill server's whole KV pool (`pool_handle` -> `MappedPool`: CUDA IPC on a
GPU, the pool's shared-memory file on a CPU, `KVPool(shared=True)`): its keys and values, the checksum records its
forward keeps as it writes them (`KVPool(slot_sums=True)`), and its pages' epochs (how often each was handed out,
in host shared memory); it keeps the mapping until it unpairs. For each request the prefill engine *pins* the pages
holding the KV to send (`pin_pages`: a reference in its allocator, so no page is freed or reused while the transfer
is in flight; pages whose KV the forward did not write, loaded from the host tier, get their records now) and names
them with their epochs (`PinnedKV.handle`): no device work, no checksums computed or sent. The decode engine writes
the transfer in one pass (`MappedKV.write_into`, in its own thread between steps or as the KV lands, gated by a
pause as any import): it reads the mapped pages, writes them into its own pages and checksums what it read, and
sums the prefill side's checksums from the mapped records, both on its device, then reads both (one host read) and
compares them and the pages' epochs (`MappedKV.check`). On a difference it raises ValueError naming the first page
that differs, and the engine frees the pages it wrote and ends the request (nothing of it is seen). Then it settles
the import (`MappedKV.settle`): its server tells the prefill server, which unpins the pages (`PinnedKV.free`); if it
never does (a decode server that died), the prefill server unpins them after its timeout, and a decode server that
reads them later finds them handed out again (their epochs changed): it never keeps them.

The checksums are `kv_transfer.page_sums`'s, computed from the pool by index, no gather buffer
(`tandem.engine.kv_index_sums`): on a GPU by the Triton kernels of `tandem.kernels.kv_copy` (which copies in the same
pass) and `tandem.kernels.kv_sums` (the records'), elsewhere by torch (a gather, the sums, and a scatter).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

from tandem.engine.kv_index_sums import _kernel_ok, host_sums, page_sums_by_index, record_sums_by_index
from tandem.engine.kv_pool import KVPool
from tandem.engine.kv_shared import (
    _b64,
    _dtype,
    _gpu_uuid,
    _local_gpu,
    _unb64,
    ipc_describe,
    ipc_open,
)
from tandem.engine.kv_transfer import TransferClock, _hex

__all__ = ["MappedKV", "MappedPool", "PinnedKV", "pin_pages", "pool_handle", "why_not_mappable"]


def why_not_mappable(pool: KVPool) -> str | None:
    """Why another process cannot map `pool` for transfers by reference (`pool_handle`), or pin its pages
    (`pin_pages`); None if it can."""
    if pool.sums is None or pool.epochs_path is None:
        return "this pool keeps no checksum records or no epochs in shared memory (KVPool(slot_sums=True), /dev/shm)"
    if not pool.k_cache.is_cuda and pool.shm_path is None:
        return "this pool is not in shared memory (KVPool(shared=True))"
    return None


def pool_handle(pool: KVPool) -> dict:
    """What another process of this host needs to map `pool` (JSON): its identity, dtype and shape, its epochs'
    shared-memory file, and on a GPU its keys, values and checksum records by CUDA IPC (a fresh reference counter
    each call), on a CPU its shared-memory file (keys, values, then the records from `records_offset`);
    ValueError if it cannot be mapped (`why_not_mappable`)."""
    if (why := why_not_mappable(pool)) is not None:
        raise ValueError(f"kv transfer: {why}")
    k = pool.k_cache
    handle = {"pool": pool.share_id, "dtype": str(k.dtype).removeprefix("torch."), "shape": list(k.shape),
              "page_size": pool.page_size, "num_pages": pool.num_pages, "epochs": pool.epochs_path}
    if k.is_cuda:
        with torch.cuda.device(k.device):
            return handle | {"kind": "cuda", "gpu": _gpu_uuid(k.device),
                             "tensors": [ipc_describe(t) for t in (pool.k_cache, pool.v_cache, pool.sums)]}
    return handle | {"kind": "cpu", "path": pool.shm_path, "records_offset": pool.sums.storage_offset() * 8}


def _map_file(path: str, nbytes: int) -> torch.Tensor:
    """`nbytes` of another process's shared-memory file (a `/proc/PID/fd/N` path of `kv_pool._shared_memory`), mapped
    here as uint8; ValueError if it is not a file of that size."""
    if not path.startswith("/proc/") or (size := os.path.getsize(path)) != nbytes:
        raise ValueError(f"{path} is not a file of {nbytes} bytes")
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


class MappedPool:
    """A prefill server's KV pool mapped into this process (`pool_handle`'s `handle`): `k`, `v` [L, S, K, D] and
    `records` [S, L, 2] (int64) its own memory, read where a transfer names pages of it; `epochs` [num_pages]
    (int64 numpy, on the host) read as a transfer is checked. ValueError if it cannot be mapped here."""

    def __init__(self, handle: dict, device: torch.device | str):
        try:
            self.id, self.page_size = str(handle["pool"]), int(handle["page_size"])
            self.num_pages, dtype = int(handle["num_pages"]), _dtype(handle)
            shape = [int(n) for n in handle["shape"]]
            self.epochs = _map_file(str(handle["epochs"]), 8 * self.num_pages).view(torch.int64).numpy()
            if handle["kind"] == "cuda":
                if (index := _local_gpu(handle["gpu"])) is None:
                    raise ValueError(f"the prefill server's GPU {handle['gpu']} is not visible to this process")
                mine = torch.device(device)
                mine = mine.index if mine.type == "cuda" and mine.index is not None else torch.cuda.current_device()
                if mine != index or torch.device(device).type != "cuda":
                    raise ValueError(f"its pool is on GPU {index} of this process, this server's KV on {device}")
                with torch.cuda.device(index):
                    self.k, self.v, self.records = (ipc_open(part, kind, index) for part, kind in zip(
                        handle["tensors"], (dtype, dtype, torch.int64), strict=True))
            elif handle["kind"] == "cpu":
                at, records = int(handle["records_offset"]), 8 * shape[1] * shape[0] * 2
                raw = _map_file(str(handle["path"]), at + records)
                kv = raw[:2 * math.prod(shape) * dtype.itemsize].view(dtype).view(2, *shape)
                self.k, self.v = kv[0], kv[1]
                self.records = raw[at:].view(torch.int64).view(shape[1], shape[0], 2)
            else:
                raise ValueError(f"no pool of kind {handle['kind']!r}")
        except (KeyError, ValueError, TypeError, OSError, RuntimeError) as e:
            raise ValueError(f"kv transfer: the prefill server's pool cannot be mapped ({type(e).__name__}: {e})") \
                from None
        if list(self.k.shape) != shape or self.k.dtype != dtype or list(self.records.shape) != [shape[1], shape[0], 2]:
            raise ValueError(f"kv transfer: the mapped pool is {tuple(self.k.shape)} {self.k.dtype}, not {shape}")
        self._graphs: dict[int, object] = {}  # a destination pool's id -> its `kv_pass_graph.PassGraphs`

    def pass_graphs(self, pool: KVPool):
        """The passes from this pool into `pool` as CUDA graphs (`kv_pass_graph.PassGraphs`, made once)."""
        from tandem.engine.kv_pass_graph import PassGraphs

        if (graphs := self._graphs.get(id(pool))) is None:
            graphs = self._graphs[id(pool)] = PassGraphs(self.k, self.v, self.records, pool.k_cache, pool.v_cache,
                                                         self.page_size)
        return graphs


class PinnedKV:
    """A prefill engine's export by reference: positions [start, end) of a sequence, held in `pages` (one per page
    of `page_size` from `start`) of its pool, pinned until `free`, each in the epoch it had when pinned (`epochs`,
    int64: the pool's count of times each was handed out), and `routing` ([end - start, layers, k] int16 on the
    host) where the pool keeps it. No checksums travel: the decode server takes the prefill side's from the pool's
    records, which it maps (`MappedKV.pass_into`). `handle`: what the decode server needs (JSON; the pages and the
    epochs as the hex of their little-endian bytes: int32 and int64); `unpin(pages)` is called once, by `free` or
    when this is collected. `read_s`: the pinning's time on the host; `pinned_at`: `time.monotonic()` as it began.
    `ready_at`: `time.monotonic()` once the engine had the result of the step that computed its KV (None before:
    its pages may not be read yet). `recorded`: where the pinning queued checksum records (pages the forward did not
    write), an event behind them: nobody may read the pages before it is done (`is_recorded`, `wait_recorded`);
    else None."""

    def __init__(self, pool: KVPool, pages: list[int], start: int, end: int, epochs: np.ndarray,
                 routing: torch.Tensor | None, unpin: Callable[[list[int]], None], read_s: float, pinned_at: float,
                 recorded: torch.cuda.Event | None = None):
        self.pages, self.start, self.end, self.page_size = pages, start, end, pool.page_size
        self.epochs, self.routing, self.read_s, self.pinned_at = epochs, routing, read_s, pinned_at
        self.recorded, self.ready_at = recorded, None
        self.pool_id, self._records = pool.share_id, pool.sums
        self._unpin = weakref.finalize(self, unpin, pages)  # (an export dropped unfreed unpins as it goes)

    @functools.cached_property
    def handle(self) -> dict:
        """(Built when first asked for, by the server's thread: not on the engine's way to the mail; the host waits
        for the records first, `wait_recorded`: whoever has the handle may read them.)"""
        self.wait_recorded()
        handle = {"kind": "pages", "pool": self.pool_id, "start": self.start, "end": self.end,
                  "page_size": self.page_size, "pages": np.asarray(self.pages, dtype="<i4").tobytes().hex(),
                  "epochs": np.asarray(self.epochs, dtype="<i8").tobytes().hex()}
        if self.routing is not None:
            handle["routing"] = {"data": _b64(self.routing.contiguous().numpy().tobytes()),
                                 "shape": list(self.routing.shape)}
        return handle

    def is_recorded(self) -> bool:
        """Whether the records of its pages are complete (a decode server may read them now)."""
        return self.recorded is None or self.recorded.query()

    def wait_recorded(self) -> None:
        """Wait (the host) until the records of its pages are complete."""
        if self.recorded is not None:
            self.recorded.synchronize()

    @property
    def checksums(self) -> tuple[str, ...]:
        """The pages' checksums as `page_checksums` has them, from the records as they are now (the host waits)."""
        self.wait_recorded()
        return _hex_pairs(host_sums(record_sums_by_index(self._records, self.pages, self.start, self.end,
                                                         self.page_size)))

    def free(self, taken: bool) -> None:
        """Unpin the pages (once; `taken` is ignored: the decode server maps the pool, not this export). An export
        nobody frees unpins its pages when it is collected."""
        self._unpin()


def pin_pages(pool: KVPool, pages: list[int], start: int, end: int,
              unpin: Callable[[list[int]], None]) -> PinnedKV:
    """Pin the pages holding positions [start, end) (`start` page-aligned) of a sequence with page table `pages`
    (a reference each, which `unpin` drops: the engine's thread-safe way back into its allocator) and note their
    epochs; pages whose KV the forward did not write get their checksum records now (`KVPool.record_pages`, behind
    whatever wrote them: `PinnedKV.recorded`). Call in the engine's thread, between steps, once the step that
    computes the KV has been launched (queued): nobody may read the pages until it has run (the engine's result of
    it in hand, its sampled tokens, which the device writes after the KV and the forward's records: then the engine
    sets `PinnedKV.ready_at`). ValueError if the pool keeps no records or epochs."""
    P = pool.page_size
    assert start % P == 0, start
    if (why := why_not_mappable(pool)) is not None:
        raise ValueError(f"kv transfer: no pinned export: {why}")
    began, pinned_at = time.perf_counter(), time.monotonic()
    held = list(pages[start // P:-(-end // P)])
    pool.incref(held)
    try:
        recorded = pool.record_pages(held)
        epochs = pool.epochs[held]  # (a copy)
        routing = None if pool.routing is None else pool.routing[pool.slots(pages, start, end)].cpu()
    except BaseException:
        pool.decref(held)
        raise
    return PinnedKV(pool, held, start, end, epochs, routing, unpin, time.perf_counter() - began, pinned_at,
                    recorded)


def _hex_pairs(sums: np.ndarray) -> tuple[str, ...]:
    """`page_sums` [pages, 2] as `page_checksums` gives them."""
    return tuple(_hex(pair) for pair in sums.tolist())


class MappedKV:
    """A decode server's import by reference: what a prefill server's `PinnedKV.handle` names in the pool `source`
    maps (positions [start, end), their pages there and the pages' epochs, routing), from the prefill server
    `origin` (named in errors), export `export_id`. Nothing is read until the engine writes it (`write_into`: the
    pass, `pass_into`, then its comparison, `check`); `verify` checks nothing. `settled` is done once the engine
    wrote it or dropped it (`settle`): its server may then release the export. The handle's pages and epochs may
    also be numpy arrays (int32, int64 [pages]: a mail's, `tandem.server.disagg_mailbox`)."""

    def __init__(self, source: MappedPool, handle: dict, origin: str = "", export_id: str = ""):
        try:
            if handle["kind"] != "pages" or handle["pool"] != source.id:
                raise ValueError(f"it names pool {handle.get('pool')!r} ({handle['kind']}), the one mapped is "
                                 f"{source.id!r} (the prefill server restarted?)")
            self.start, self.end, self.page_size = int(handle["start"]), int(handle["end"]), int(handle["page_size"])
            self.pages, self.epochs = (x if isinstance(x, np.ndarray) else np.frombuffer(  # (as `PinnedKV.handle`)
                bytes.fromhex(str(x)), dtype=kind) for x, kind in ((handle["pages"], "<i4"), (handle["epochs"], "<i8")))
            if self.pages.dtype != np.dtype("<i4") or self.epochs.dtype != np.dtype("<i8") \
                    or self.epochs.shape != self.pages.shape:
                raise ValueError("pages and epochs must be int32 and int64, one each a page")
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
        self.sums: np.ndarray | None = None  # (the prefill side's, from its records, as `pass_into` read them)
        self.mine: np.ndarray | None = None  # (the sums of what `pass_into` read)
        self._read = None  # (`launch_pass`'s sums on their way: a `HostRead`, or the graph's, in hand)
        self.epochs_after: np.ndarray | None = None  # (the pages' epochs once `pass_into` had read them)
        self.failure: str | None = None  # (`check`'s difference, once checked)
        self.checked = False
        self.mail: dict | None = None  # (the head of the mail it came by, `disagg_mailbox`; None: by the answer)

    @property
    def checksums(self) -> tuple[str, ...]:
        """The prefill side's checksums (once `pass_into` ran), as `page_checksums` gives them."""
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
        mapped pages, and check them (`pass_into`, then `check`, raising its ValueError). Call in the engine's
        thread (or with the pages owned otherwise: `EngineCore.write_reserved`)."""
        self.pass_into(pool, pages)
        if self.check() is not None:
            raise ValueError(self.failure)

    def pass_into(self, pool: KVPool, pages: list[int], graphs: bool = False) -> None:
        """The pass of `write_into`: the pages written, the sums of what was read (`mine`) and the prefill side's
        from its records (`sums`), read back by the host (one copy, queued right behind the kernels: `HostRead`),
        then the pages' epochs (`epochs_after`): `launch_pass`, then `finish_pass`."""
        self.launch_pass(pool, pages, graphs)
        self.finish_pass()

    def launch_pass(self, pool: KVPool, pages: list[int], graphs: bool = False) -> None:
        """Queue `pass_into`'s pass on the current stream (the host waits for nothing; `finish_pass` does). ValueError
        if the routing the pool keeps is missing, or pages are of another size. Marks `clock` "write" and "written"
        around the pass (device events on a GPU; "launch" as its kernels are launched). `graphs`: on a GPU, the pass
        replayed as a CUDA graph (`kv_pass_graph`; the caller serialises passes into `pool`, as
        `EngineCore.write_reserved` does), which the host waits for here."""
        P = self.page_size
        if pool.routing is not None and self.routing is None:
            raise ValueError("kv: the sender kept no routing, which this pool keeps (enable_return_routed_experts)")
        if pool.page_size != P:
            raise ValueError(f"kv transfer: pages of {P} positions, this pool's of {pool.page_size}")
        clock = self.clock = self.clock or TransferClock(pool.k_cache.device)
        clock.mark("write")
        mine = pages[self.start // P:-(-self.end // P)]
        pool.mark_unsummed(mine)
        if pool.routing is not None:  # (before the pass: a copy from pageable memory waits for the stream's work)
            pool.routing[pool.slots(pages, self.start, self.end)] = self.routing.to(pool.routing.device)
        if graphs and _kernel_ok(self.source.k, self.source.v, pool.k_cache, pool.v_cache):
            self._read = self.source.pass_graphs(pool).run(self.pages, mine, self.start, self.end, clock)
        else:
            self._read = page_sums_by_index(self.source.k, self.source.v, self.pages, self.start, self.end, P,
                                            pool.k_cache, pool.v_cache, mine, clock, records=self.source.records,
                                            read=True)
            clock.mark("written")

    def finish_pass(self) -> None:
        """After `launch_pass`: the host waits for the pass's sums (`clock` marked "synced" as the wait returns),
        takes them, then reads the pages' epochs; marks "passed" once it has both."""
        read, self._read = self._read, None
        self.mine, self.sums = read if isinstance(read, np.ndarray) else read.result(self.clock)
        self.epochs_after = self.source.epochs[self.pages]  # (after the reads: see `check`)
        self.clock.mark("passed", device=False)

    def check(self) -> str | None:
        """After `pass_into`: None if what it read was what the prefill server pinned, else (also kept as
        `failure`) a message naming the first page that differs (the pages written then hold bytes nobody may
        use). A page whose epoch changed was handed out again (its export freed: released, or timed out) before
        the read had ended, which may have read its new KV, whose records match it; otherwise the sums of what
        was read must be the records'. (A page is handed out, its epoch counted, before anything is written into
        it, so an epoch read unchanged after the read has ended means nothing of its new life was read.) Marks
        `clock` "checked"."""
        if self.mine is None:
            raise ValueError("kv transfer: checked before its pass ran")
        self.checked = True
        if self.clock is not None:
            self.clock.mark("checked", device=False)
        where = "the prefill server" if not self.origin else self.origin
        if (moved := np.flatnonzero(self.epochs_after != self.epochs)).size:
            i = int(moved[0])
            self.failure = (f"kv transfer from {where}: page {i} (positions {self.start + i * self.page_size}...) "
                            "was handed out again before it was read (its export freed)")
        elif not np.array_equal(self.mine, self.sums):
            i = int(np.flatnonzero((self.mine != self.sums).any(axis=1))[0])
            self.failure = (f"kv transfer from {where}: page {i} (positions {self.start + i * self.page_size}...) "
                            "arrived with another checksum than it left with")
        return self.failure
