"""The host tier: KV pages in host memory under the radix cache, and the copies between the two tiers.

Host page h holds the keys and values of `page_size` positions for every layer contiguously, `kv[h]` of
shape [2, L, P, K, D] (pinned on CUDA machines), so a run of consecutive host pages is one copy. A pool that keeps
each slot's routed experts (`KVPool.routing`) has them moved with the KV, in the same copies (`routing[h]`:
[P, layers, k]).

Each copy is two halves: the bus transfer, on a side stream, and a device-side gather or scatter between the pool
and a staging tensor of its own, on the compute stream, in the step's order:
  - a backup gathers its device pages into staging on the compute stream (`tier_gather`: after the compute that
    wrote them, before any that reuses them, so the device pages are free at once), then copies the staging to
    the host on the backup stream (`tier_backup`), which the step never waits for;
  - a load copies its host pages into staging on the tier stream as soon as it is issued (`tier_load`: it touches
    no pool page, so it waits for no compute and overlaps the step in flight), and the compute stream waits for
    it and scatters the staging into the pool (`tier_join`, `before_compute`) before the step that reads them.
The ordering rules, each enforced here (docs/streams.md has them as edges, `tandem.engine.step_order` as data):
  1. pool pages are read and written only on the compute stream, in the step's order;
  2. the scatter waits for its transfer (`before_compute` is called before anything reads the pages);
  3. a copy holds a reference on every host page it touches, and a load on the pool pages it fills, until it is
     reaped, so nothing is freed and reused under it; its staging tensors live as long;
  4. a load never reads a host page whose backup is still in flight: it takes that page from the backup's
     staging instead (on the device, already gathered);
  5. copies are reaped in issue order up to a point rank 0 decides (`ready`) and every rank applies, so under
     tensor parallelism all ranks free the same pages at the same step and take the same decisions.
On CPU a transfer lands as it is issued (the same state machine, synchronous). With `deferred=True` a transfer
lands only when `land` runs it, when it is reaped, or (a load's) when its scatter needs it: the tests use this to
catch any broken rule, since a page freed too early or read too early then holds the wrong values.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import get_args

import torch

from tandem.config import HostCache
from tandem.engine.kv_pool import KVPool, PageAllocator
from tandem.engine.streams import StreamRuntime, engine_placements

log = logging.getLogger(__name__)

POLICIES = get_args(HostCache)  # ("off", "write_through", "write_back")


@dataclass(eq=False)
class CopyOp:
    """One copy. `device_pages`: the pool pages a load fills (a backup holds none: its gather has read them)."""

    id: int
    device_pages: list[int]
    host_pages: list[int]
    is_load: bool
    staged: tuple = ()  # device staging: (KV [n, 2, L, P, K, D], routing [n, P, layers, k] or None)
    done: torch.cuda.Event | None = None  # CUDA: after the transfer (backup) or the scatter (load)
    pending: Callable | None = None  # deferred mode: the transfer itself, not landed yet
    joined: bool = False  # a load: scattered into the pool
    # a load: (index in the load, backup in flight, index in that backup) of each page taken from a backup
    from_backups: list[tuple[int, CopyOp, int]] = field(default_factory=list)


class HostTier(PageAllocator):
    def __init__(self, pool: KVPool, num_pages: int, policy: str = "write_through", deferred: bool = False,
                 order: StreamRuntime | None = None):
        if policy not in POLICIES[1:]:
            raise ValueError(f"engine.host_cache: a tier's policy is one of {POLICIES[1:]}, got {policy!r}")
        super().__init__(num_pages, pool.page_size)
        self.pool, self.policy, self.deferred = pool, policy, deferred
        L, _, K, D = pool.k_cache.shape
        self.cuda = pool.k_cache.is_cuda
        self.kv = torch.zeros((num_pages, 2, L, pool.page_size, K, D), dtype=pool.k_cache.dtype,
                              pin_memory=self.cuda)
        self.routing = None if pool.routing is None else torch.full(
            (num_pages, pool.page_size, *pool.routing.shape[1:]), -1, dtype=pool.routing.dtype, pin_memory=self.cuda)
        # where the copies run and what they wait for: the works tier_gather, tier_backup, tier_load and tier_join
        # of `tandem.engine.step_order`; shared with the model runner by the engine core
        self.order = order or StreamRuntime(engine_placements(), pool.k_cache.device)
        self.ops: deque[CopyOp] = deque()
        self._unjoined: list[CopyOp] = []  # loads issued, not scattered yet
        self._backing: dict[int, tuple[CopyOp, int]] = {}  # host page -> the backup in flight filling it (rule 4)
        self.issued = 0  # id of the last copy issued
        # the engine sets this: copies up to this id were issued before the step in flight was launched, so
        # they wait for no compute still running, only for their own transfer
        self.settled_upto = 0
        self.pages_loaded = self.pages_backed_up = 0
        self.pages_from_backups = 0  # loaded pages taken from a backup's staging (rule 4)
        # host time: issuing copies, and waiting for them (reaps that had to block; `waits` counts those copies)
        self.issue_seconds = self.wait_seconds = 0.0
        self.waits = 0

    @property
    def bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    # ---- issuing copies --------------------------------------------------------------------------------
    def backup(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy device pages into host pages (their tree references are the caller's business). The device
        pages are read at once, in the compute stream's order: the caller may free them right after."""
        t0 = time.perf_counter()
        op = self._new_op([], host_pages, is_load=False)
        with self.order.work("tier_gather"):
            op.staged = self._gather(device_pages)
        with self.order.work("tier_backup"):
            self._transfer(op, lambda: self._to_host(op))
        for i, h in enumerate(host_pages):
            self._backing[h] = (op, i)
        self.pages_backed_up += len(host_pages)
        self.issue_seconds += time.perf_counter() - t0

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy host pages into device pages. Call `before_compute` before anything reads them."""
        t0 = time.perf_counter()
        op = self._new_op(device_pages, host_pages, is_load=True)
        op.from_backups = [(i, *b) for i, h in enumerate(host_pages) if (b := self._in_flight_backup(h)) is not None]
        with self.order.work("tier_load"):
            op.staged = self._staging(len(host_pages))
            self._transfer(op, lambda: self._from_host(op))
        self._unjoined.append(op)
        self.pages_loaded += len(device_pages)
        self.pages_from_backups += len(op.from_backups)
        self.issue_seconds += time.perf_counter() - t0

    def before_compute(self) -> None:
        """Scatter every load issued so far into its pool pages, on the compute stream after its transfer
        (rule 2): whatever the compute stream runs next reads them loaded."""
        if not self._unjoined:
            return
        ops, self._unjoined = self._unjoined, []
        with self.order.work("tier_join"):  # (on CUDA: the compute stream waits for the last load's transfer)
            for op in ops:
                if op.pending is not None:  # deferred: the scatter waits for the transfer
                    op.pending, run = None, op.pending
                    run()
                self._scatter(op)
                op.joined = True
                if self.cuda:
                    op.done = torch.cuda.Event()
                    op.done.record()

    def _in_flight_backup(self, host_page: int) -> tuple[CopyOp, int] | None:
        """(the backup, the page's index in it) still filling `host_page`, if any (rule 4)."""
        return self._backing.get(host_page)

    def _new_op(self, device_pages: list[int], host_pages: list[int], is_load: bool) -> CopyOp:
        self.issued += 1
        op = CopyOp(self.issued, list(device_pages), list(host_pages), is_load)
        self._hold(op)
        self.ops.append(op)
        return op

    def _hold(self, op: CopyOp) -> None:
        """Rule 3: the pages a copy touches stay allocated until it is reaped."""
        self.pool.incref(op.device_pages)
        self.incref(op.host_pages)

    def _unhold(self, op: CopyOp) -> None:
        self.pool.decref(op.device_pages)
        self.decref(op.host_pages)

    def _transfer(self, op: CopyOp, run: Callable) -> None:
        """Run a bus transfer on the current (side) stream: now on CUDA or CPU, later in deferred mode."""
        if self.cuda:
            run()
            if not op.is_load:  # (a load's completion is its scatter's, on the compute stream)
                op.done = torch.cuda.Event()
                op.done.record()
        elif self.deferred:
            op.pending = run
        else:
            run()

    # ---- the copies' halves ------------------------------------------------------------------------------
    def _views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The pool by page: k, v [L, pages, P, K, D] and routing [pages, P, layers, k]."""
        pool, P = self.pool, self.page_size
        L, _, K, D = pool.k_cache.shape
        routing = None if pool.routing is None else pool.routing.view(-1, P, *pool.routing.shape[1:])
        return pool.k_cache.view(L, -1, P, K, D), pool.v_cache.view(L, -1, P, K, D), routing

    def _index(self, pages: list[int], device: torch.device) -> torch.Tensor:
        idx = torch.tensor(pages, dtype=torch.long)
        if idx.device != device:
            idx = idx.pin_memory().to(device, non_blocking=True)  # pageable memory would sync the stream
        return idx

    def _staging(self, n: int) -> tuple:
        kv = torch.empty((n, *self.kv.shape[1:]), dtype=self.kv.dtype, device=self.pool.k_cache.device)
        routing = None if self.routing is None else torch.empty(
            (n, *self.routing.shape[1:]), dtype=self.routing.dtype, device=self.pool.routing.device)
        return kv, routing

    def _gather(self, device_pages: list[int]) -> tuple:
        """Staging [n, 2, L, P, K, D] (and routing) holding the pool pages, read on the current stream."""
        k, v, routing = self._views()
        idx = self._index(device_pages, k.device)
        kv = torch.stack((k[:, idx], v[:, idx])).permute(2, 0, 1, 3, 4, 5).contiguous()
        return kv, None if routing is None else routing[idx]  # (indexing copies)

    def _to_host(self, op: CopyOp) -> None:
        kv, routing = op.staged
        for i, h, n in _runs(op.host_pages):
            self.kv[h:h + n].copy_(kv[i:i + n], non_blocking=True)
            if routing is not None:
                self.routing[h:h + n].copy_(routing[i:i + n], non_blocking=True)

    def _from_host(self, op: CopyOp) -> None:
        """The load's host pages into its staging, but for those taken from a backup in flight (rule 4)."""
        kv, routing = op.staged
        skip = {i for i, _, _ in op.from_backups}
        for i, h, n in _runs(op.host_pages, skip):
            kv[i:i + n].copy_(self.kv[h:h + n], non_blocking=True)
            if routing is not None:
                routing[i:i + n].copy_(self.routing[h:h + n], non_blocking=True)

    def _scatter(self, op: CopyOp) -> None:
        """The load's staging into its pool pages (on the current stream: compute)."""
        kv, routing = op.staged
        for i, backup, j in op.from_backups:  # gathered earlier on this stream: no wait
            kv[i] = backup.staged[0][j]
            if routing is not None:
                routing[i] = backup.staged[1][j]
        k, v, pool_routing = self._views()
        idx = self._index(op.device_pages, k.device)
        k[:, idx] = kv[:, 0].transpose(0, 1)
        v[:, idx] = kv[:, 1].transpose(0, 1)
        if routing is not None:
            pool_routing[idx] = routing

    # ---- completion ------------------------------------------------------------------------------------
    def land(self, upto: int) -> None:
        """Deferred mode: the transfers up to id `upto` land now (in order)."""
        for op in self.ops:
            if op.id > upto:
                break
            if op.pending is not None:
                op.pending, run = None, op.pending
                run()

    def ready(self) -> int:
        """The id up to which every copy has completed: the reap point (rank 0 decides it, see rule 5)."""
        last = 0
        for op in self.ops:
            if (op.pending is not None or (op.is_load and not op.joined)
                    or (op.done is not None and not op.done.query())):
                break
            last = op.id
        return last

    def reap(self, upto: int | None = None) -> None:
        """Wait for the copies up to id `upto` (every one if None) and drop the references they hold."""
        while self.ops and (upto is None or self.ops[0].id <= upto):
            op = self.ops[0]
            assert not op.is_load or op.joined, "a load is reaped before its scatter (call before_compute)"
            if op.pending is not None or (op.done is not None and not op.done.query()):
                t0 = time.perf_counter()
                self.land(op.id)
                if op.done is not None:
                    op.done.synchronize()
                self.waits += 1
                self.wait_seconds += time.perf_counter() - t0
            self.ops.popleft()
            self._release(op)

    def _release(self, op: CopyOp) -> None:
        self._unhold(op)
        if not op.is_load:
            for h in op.host_pages:
                if self._backing.get(h, (None,))[0] is op:
                    del self._backing[h]

    @property
    def in_flight(self) -> int:
        return len(self.ops)


def _runs(pages: list[int], skip: set[int] = frozenset()):
    """(index in `pages`, first page, length) of each run of consecutive page ids, leaving out the indices in
    `skip`."""
    start = None
    for i in range(len(pages) + 1):
        if start is not None and (i == len(pages) or i in skip or pages[i] != pages[i - 1] + 1):
            yield start, pages[start], i - start
            start = None
        if start is None and i < len(pages) and i not in skip:
            start = i
