"""The host tier: KV pages in host memory under the radix cache, and the copies between the two tiers.

Host page h holds the keys and values of `page_size` positions for every layer contiguously, `kv[h]` of
shape [2, L, P, K, D] (pinned on CUDA machines), so a run of consecutive host pages is one copy. A pool that keeps
each slot's routed experts (`KVPool.routing`) has them moved with the KV, in the same copies' order
(`routing[h]`: [P, layers, k]).

Copies run in issue order on one side stream, so a load from a host page always follows the backup that
filled it. The ordering rules, each enforced here:
  1. a copy starts only after every compute already launched: a backup may read pages the step in flight
     is writing, and a load may write pages that step still reads (freed by a request that just finished);
  2. compute launched after a load waits for it (`before_compute`);
  3. every page a copy touches, device and host, holds a reference until the copy is reaped, so nothing is
     freed and reused under it; its index and staging tensors live as long;
  4. copies are reaped in issue order up to a point rank 0 decides (`ready`) and every rank applies, so under
     tensor parallelism all ranks free the same pages at the same step and take the same decisions.
On CPU a copy lands as it is issued (the same state machine, synchronous). With `deferred=True` a copy lands
only when `land` runs it or when it is reaped: the tests use this to catch any broken rule, since a page
freed too early or read too early then holds the wrong values.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import get_args

import torch

from tandem.config import HostCache
from tandem.engine.kv_pool import KVPool, PageAllocator
from tandem.engine.streams import StreamRuntime, engine_placements

log = logging.getLogger(__name__)

POLICIES = get_args(HostCache)  # ("off", "write_through", "write_back")


@dataclass(eq=False)
class CopyOp:
    id: int
    device_pages: list[int]
    host_pages: list[int]
    is_load: bool
    done: torch.cuda.Event | None = None  # CUDA: recorded on the side stream after the copy
    keep: tuple = ()  # tensors the copy uses: alive until it is reaped (rule 3)
    pending: Callable | None = None  # deferred mode: the copy itself, not landed yet


class HostTier(PageAllocator):
    def __init__(self, pool: KVPool, num_pages: int, policy: str = "write_through", deferred: bool = False,
                 order: StreamRuntime | None = None):
        if policy not in POLICIES[1:]:
            raise ValueError(f"engine.host_cache: a tier's policy is one of {POLICIES[1:]}, got {policy!r}")
        super().__init__(num_pages, pool.page_size)
        self.pool, self.policy, self.deferred = pool, policy, deferred
        L, _, K, D = pool.k_cache.shape
        cuda = pool.k_cache.is_cuda
        self.kv = torch.zeros((num_pages, 2, L, pool.page_size, K, D), dtype=pool.k_cache.dtype, pin_memory=cuda)
        self.routing = None if pool.routing is None else torch.full(
            (num_pages, pool.page_size, *pool.routing.shape[1:]), -1, dtype=pool.routing.dtype, pin_memory=cuda)
        # where the copies run and what they wait for: the works tier_backup, tier_load and tier_join of
        # `tandem.engine.step_order` (rules 1 and 2); shared with the model runner by the engine core
        self.order = order or StreamRuntime(engine_placements(), pool.k_cache.device)
        self.stream = self.order.stream("tier") if cuda else None
        self.ops: deque[CopyOp] = deque()
        self._last_load: CopyOp | None = None
        self.issued = 0  # id of the last copy issued
        # the engine sets this: copies up to this id were issued before the step in flight was launched, so
        # they wait for no compute still running, only for their own transfer
        self.settled_upto = 0
        self.pages_loaded = self.pages_backed_up = 0
        # host time: issuing copies, and waiting for them (reaps that had to block)
        self.issue_seconds = self.wait_seconds = 0.0

    @property
    def bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    # ---- issuing copies --------------------------------------------------------------------------------
    def backup(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy device pages into host pages (their tree references are the caller's business)."""
        self._issue(device_pages, host_pages, is_load=False)
        self.pages_backed_up += len(device_pages)

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy host pages into device pages. Call `before_compute` before anything reads them."""
        self._last_load = self._issue(device_pages, host_pages, is_load=True)
        self.pages_loaded += len(device_pages)

    def _issue(self, device_pages: list[int], host_pages: list[int], is_load: bool) -> CopyOp:
        t0 = time.perf_counter()
        self.issued += 1
        op = CopyOp(self.issued, list(device_pages), list(host_pages), is_load)
        self._hold(op)
        with self.order.work("tier_load" if is_load else "tier_backup"):  # (on CUDA: rule 1, the tier's stream)
            if self.stream is not None:
                op.keep = self._copy(op)
                op.done = torch.cuda.Event()
                op.done.record(self.stream)
            elif self.deferred:
                op.pending = lambda: self._copy(op)
            else:
                self._copy(op)
        self.ops.append(op)
        self.issue_seconds += time.perf_counter() - t0
        return op

    def _copy(self, op: CopyOp) -> tuple:
        pool, P = self.pool, self.page_size
        L, _, K, D = pool.k_cache.shape
        k, v = pool.k_cache.view(L, -1, P, K, D), pool.v_cache.view(L, -1, P, K, D)
        idx = torch.tensor(op.device_pages, dtype=torch.long)
        if idx.device != k.device:
            idx = idx.pin_memory().to(k.device, non_blocking=True)  # pageable memory would sync the stream
        if op.is_load:
            staged = torch.empty((len(idx), 2, L, P, K, D), dtype=k.dtype, device=k.device)
            for i, h, n in _runs(op.host_pages):
                staged[i:i + n].copy_(self.kv[h:h + n], non_blocking=True)
            k[:, idx] = staged[:, 0].transpose(0, 1)
            v[:, idx] = staged[:, 1].transpose(0, 1)
        else:
            staged = torch.stack((k[:, idx], v[:, idx])).permute(2, 0, 1, 3, 4, 5).contiguous()
            for i, h, n in _runs(op.host_pages):
                self.kv[h:h + n].copy_(staged[i:i + n], non_blocking=True)
        if self.routing is None:
            return idx, staged
        return idx, staged, self._copy_routing(op, idx)

    def _copy_routing(self, op: CopyOp, idx: torch.Tensor) -> torch.Tensor:
        """The routed experts of the copy's pages, the same way as their KV."""
        routing = self.pool.routing.view(-1, self.page_size, *self.pool.routing.shape[1:])  # [pages, P, layers, k]
        if op.is_load:
            staged = torch.empty((len(idx), *routing.shape[1:]), dtype=routing.dtype, device=routing.device)
            for i, h, n in _runs(op.host_pages):
                staged[i:i + n].copy_(self.routing[h:h + n], non_blocking=True)
            routing[idx] = staged
        else:
            staged = routing[idx]  # (indexing copies)
            for i, h, n in _runs(op.host_pages):
                self.routing[h:h + n].copy_(staged[i:i + n], non_blocking=True)
        return staged

    def before_compute(self) -> None:
        """Make the compute stream wait for every load issued so far (rule 2)."""
        op, self._last_load = self._last_load, None
        if op is None:
            return
        with self.order.work("tier_join"):  # (on CUDA: the compute stream waits for the last load's event)
            if op.pending is not None:
                self.land(op.id)

    # ---- completion ------------------------------------------------------------------------------------
    def land(self, upto: int) -> None:
        """Deferred mode: the copies up to id `upto` land now (in order, like the stream)."""
        for op in self.ops:
            if op.id > upto:
                break
            if op.pending is not None:
                op.pending, run = None, op.pending
                run()

    def ready(self) -> int:
        """The id up to which every copy has landed: the reap point (rank 0 decides it, see rule 4)."""
        last = 0
        for op in self.ops:
            if op.pending is not None or (op.done is not None and not op.done.query()):
                break
            last = op.id
        return last

    def reap(self, upto: int | None = None) -> None:
        """Wait for the copies up to id `upto` (every one if None) and drop the references they hold."""
        while self.ops and (upto is None or self.ops[0].id <= upto):
            self.land(self.ops[0].id)
            op = self.ops.popleft()
            if op.done is not None and not op.done.query():
                t0 = time.perf_counter()
                op.done.synchronize()
                self.wait_seconds += time.perf_counter() - t0
            self._release(op)
        if not self.ops:
            self._last_load = None

    def _hold(self, op: CopyOp) -> None:
        """Rule 3: the pages a copy touches stay allocated until it is reaped."""
        self.pool.incref(op.device_pages)
        self.incref(op.host_pages)

    def _release(self, op: CopyOp) -> None:
        self.pool.decref(op.device_pages)
        self.decref(op.host_pages)

    @property
    def in_flight(self) -> int:
        return len(self.ops)


def _runs(pages: list[int]):
    """(index in `pages`, first page, length) of each run of consecutive page ids."""
    start = 0
    for i in range(1, len(pages) + 1):
        if i == len(pages) or pages[i] != pages[i - 1] + 1:
            yield start, pages[start], i - start
            start = i
