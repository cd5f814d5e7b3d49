"""The host tier: KV pages in host memory under the radix cache, and the copies between the two tiers.

Host page h holds the keys and values of `page_size` positions for every layer contiguously, `kv[h]` of
shape [2, L, P, K, D] (pinned on CUDA machines), so a run of consecutive host pages is one copy. A pool that keeps
each slot's routed experts (`KVPool.routing`) has them moved with the KV, in the same copies (`routing[h]`:
[P, layers, k]).

Each copy is two halves: the bus transfer, on a side stream, and a device-side gather or scatter between the pool
and a staging tensor of its own, on the compute stream, in the step's order:
  - backups are queued (`backup`) and issued together as one copy by `flush`, which the engine runs once a step is
    launched (the device busy with it) and the tier's other calls and device eviction run first: so the backups of
    one engine step (every request that published a prefix or finished) cost one gather, one index upload and one
    transfer. The flush gathers their device pages
    into staging on the compute stream (`tier_gather`: after the compute that wrote them, before any that reuses
    them: the tier holds them while they are queued, and lets them go once gathered), then copies the staging to
    the host on the backup stream (`tier_backup`), which the step never waits for;
  - loads are issued together too, by `before_compute` (which the scheduler runs once its admissions are done,
    before anything reads their pages): one transfer of their host pages into staging on the tier stream
    (`tier_load`: it touches no pool page, so it waits for no compute and overlaps the step in flight), and one
    scatter of the staging into the pool on the compute stream, after the transfer (`tier_join`).
A request waiting for admission whose cached prefix is on the host has it prefetched (`prefetch`, by the scheduler, once
the engine launched the step): the transfer into staging starts while the request waits, within a budget of staging
pages, and its load at admission scatters from that staging instead of crossing the bus then. A prefetch holds its host
pages (rule 3) until it is retired (`retire`: at admission, or when the request leaves), so a prefetched host page is
never freed, reused and rewritten under it: the staging always holds what the page holds.
The ordering rules, each enforced here (docs/streams.md has them as edges, `tandem.engine.step_order` as data):
  1. pool pages are read and written only on the compute stream, in the step's order;
  2. the scatter waits for its transfer (`before_compute` is called before anything reads the pages);
  3. a copy holds a reference on every host page it touches until it is reaped, and on the pool pages it reads or
     fills until its gather or scatter is issued (every later use of a pool page is on the compute stream, after
     it: rule 1), so nothing is freed and reused under it; its staging tensors live as long;
  4. a load never reads a host page whose backup is still in flight: it takes that page from the backup's
     staging instead (on the device, already gathered);
  5. copies are reaped in issue order up to a point rank 0 decides (`ready`) and every rank applies, so under
     tensor parallelism all ranks free the same pages at the same step and take the same decisions.
With `copy="staged_kernels"` each half above is one `tandem.kernels.page_move` launch (`tandem.engine.host_moves`):
no index upload, no copy per run of host pages, no select before a scatter. With `copy="direct"` a backup is one
launch that moves its pool pages straight into its host pages on the compute stream, in the step's order (rule 1;
no staging, so rule 4 holds by that order: a load behind it reads the host page it filled; a prefetch, on the tier
stream, still leaves such pages out), a load one launch from host pages straight into its pool pages on the compute
stream (plus one per prefetch it takes pages from, after the tier stream: rule 2), a prefetch one launch into its
staging on the tier stream.
On CPU a transfer lands as it is issued (the same state machine, synchronous). With `deferred=True` a transfer
lands only when `land` runs it, when it is reaped, or (a load's) when its scatter needs it: the tests use this to
catch any broken rule, since a page freed too early or read too early then holds the wrong values.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import get_args

import torch

from tandem.config import HostCache, HostCacheCopy
from tandem.engine.host_clock import HostClock
from tandem.engine.host_moves import PageMoves
from tandem.engine.host_staged import StagedHalves
from tandem.engine.kv_pool import KVPool, PageAllocator
from tandem.engine.streams import StreamRuntime, engine_placements

log = logging.getLogger(__name__)

POLICIES = get_args(HostCache)  # ("off", "write_through", "write_back")
COPIES = get_args(HostCacheCopy)  # ("staged", "staged_kernels", "direct")


@dataclass(eq=False)
class CopyOp:
    """One copy. `device_pages`: the pool pages it holds (rule 3): a queued backup's until its gather, a load's
    until its scatter; empty after."""

    id: int
    device_pages: list[int]
    host_pages: list[int]
    is_load: bool
    staged: tuple = ()  # device staging: (KV [n, 2, L, P, K, D], routing [n, P, layers, k] or None)
    done: torch.cuda.Event | None = None  # CUDA: after the transfer (backup) or the scatter (load)
    pending: Callable | None = None  # deferred mode: the transfer itself, not landed yet
    joined: bool = False  # a load: scattered into the pool (a prefetch: retired)
    # a load: (index in the load, backup in flight or prefetch, index there) of each page taken from the staging
    # of a backup in flight (rule 4) or of a prefetch
    from_staging: list[tuple[int, CopyOp, int]] = field(default_factory=list)
    own: list[int] | None = None  # a load: the indices of its pages its own transfer brings (None: all)
    prefetch: bool = False


class HostTier(StagedHalves, PageAllocator):
    def __init__(self, pool: KVPool, num_pages: int, policy: str = "write_through", deferred: bool = False,
                 order: StreamRuntime | None = None, prefetch_pages: int | None = None, copy: str = "staged"):
        """`prefetch_pages`: the staging (device memory outside the pool) prefetches may hold at once; default an
        eighth of the pool, 0 for none. `copy`: "staged" (the halves above, torch's ops), "staged_kernels" (the same
        halves, each one `move_pages` launch) or "direct" (each copy one launch straight between pool and host
        pages, below); the last two on a CPU pool under Triton's interpreter, which only the tests want."""
        if policy not in POLICIES[1:]:
            raise ValueError(f"engine.host_cache: a tier's policy is one of {POLICIES[1:]}, got {policy!r}")
        if copy not in COPIES:
            raise ValueError(f"engine.host_cache_copy: one of {COPIES}, got {copy!r}")
        super().__init__(num_pages, pool.page_size)
        self.pool, self.policy, self.deferred = pool, policy, deferred
        L, _, K, D = pool.k_cache.shape
        P = pool.page_size
        self.cuda = pool.k_cache.is_cuda
        self.kv = torch.zeros((num_pages, 2, L, P, K, D), dtype=pool.k_cache.dtype, pin_memory=self.cuda)
        self.routing = None if pool.routing is None else torch.full(
            (num_pages, P, *pool.routing.shape[1:]), -1, dtype=pool.routing.dtype, pin_memory=self.cuda)
        # the pool by page, pages first: k, v [pages, L, P, K, D] (views), routing [pages, P, layers, k]
        self._k = pool.k_cache.view(L, -1, P, K, D).transpose(0, 1)
        self._v = pool.v_cache.view(L, -1, P, K, D).transpose(0, 1)
        self._routing = None if pool.routing is None else pool.routing.view(-1, P, *pool.routing.shape[1:])
        self.copy = copy
        self.moves = PageMoves(pool, self.kv, self.routing) if copy != "staged" else None  # (kernel launches)
        # where the copies run and what they wait for: the works tier_gather, tier_backup, tier_load, tier_join and
        # tier_prefetch of `tandem.engine.step_order`; shared with the model runner by the engine core
        self.order = order or StreamRuntime(engine_placements(), pool.k_cache.device)
        self.ops: deque[CopyOp] = deque()
        self._queued: CopyOp | None = None  # backups not flushed yet (the last of `ops` while there are any)
        self._unjoined: list[CopyOp] = []  # loads issued, not scattered yet
        self._backing: dict[int, tuple[CopyOp, int]] = {}  # host page -> the backup in flight filling it (rule 4)
        self.prefetch_pages = pool.num_pages // 8 if prefetch_pages is None else prefetch_pages
        self._prefetches: dict[str, CopyOp] = {}  # by key (a request id); in `ops` only once retired
        self._prefetched: dict[int, tuple[CopyOp, int]] = {}  # host page -> (its prefetch, index there)
        self._prefetch_held = 0  # staging pages the prefetches hold
        self.issued = 0  # id of the last copy issued
        self.pages_loaded = self.pages_backed_up = 0
        self.pages_from_backups = 0  # loaded pages taken from a backup's staging (rule 4)
        self.pages_prefetched = self.pages_from_prefetch = 0  # prefetched; loaded pages taken from a prefetch
        # copies issued (the backups of one flush are one, the loads of one `before_compute` one) and the bus
        # transfers they took (one per run of consecutive host pages)
        self.num_backups = self.num_loads = self.num_prefetches = self.num_transfers = 0
        # host time: issuing backups (queueing, and the flush's gather and transfer), loads and prefetches (their
        # transfers), the loads' scatters (`before_compute`), and waiting for copies (reaps that had to block;
        # `waits` counts those copies); and a flush's time by part, in issue order
        self.clock = HostClock(("backup", "load", "prefetch", "scatter", "wait"))
        self.flush_clock = HostClock(("index", "staging", "gather", "gather_event", "to_backup_stream", "transfer",
                                      "from_backup_stream", "done_event"))
        self.waits = 0

    @property
    def bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    # ---- issuing copies --------------------------------------------------------------------------------
    def backup(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy device pages into host pages (their tree references are the caller's business), at the next
        `flush`: until then the tier holds the device pages, so the caller may drop its references at once."""
        t0 = self.clock.now()
        if self._queued is None:
            self._queued = self._new_op([], [], is_load=False)
        op = self._queued
        op.device_pages += device_pages
        op.host_pages += host_pages
        self._hold_pool(device_pages)
        self._hold(op, host_pages)
        self.pages_backed_up += len(host_pages)
        self.clock.lap("backup", t0)

    def flush(self) -> None:
        """Issue the queued backups as one copy: a gather of their device pages into staging on the compute stream
        (the tier's references on them go: whatever reuses them runs after it), then one transfer to the host on
        the backup stream. Rule 4 applies from here: a load of one of its host pages takes it from the staging."""
        op, self._queued = self._queued, None
        if op is None:
            return
        t0 = t = self.clock.now()
        if self.copy == "direct":  # one launch, pool pages to host pages, in the step's order (rule 1)
            with self.order.work("tier_backup_direct"):
                t = self._move_out(op, t)
                op.done = self.moves.done()
            t = self.flush_clock.lap("done_event", t)
            self._drop_pool(op)
        else:
            t = self._flush_staged(op, t)
        for i, h in enumerate(op.host_pages):  # (in flight: a prefetch must not read it; a staged load neither)
            self._backing[h] = (op, i)
        self.num_backups += 1
        self.clock.lap("backup", t0)

    def _flush_staged(self, op: CopyOp, t: tuple[float, float]) -> tuple[float, float]:
        with self.order.work("tier_gather"):
            op.staged, t = self._gather(op.device_pages, t)
        t = self.flush_clock.lap("gather_event", t)
        self._drop_pool(op)
        with self.order.work("tier_backup"):
            t = self.flush_clock.lap("to_backup_stream", t)
            self._transfer(op, lambda: self._to_host(op))
            t = self.flush_clock.lap("transfer", t)
        return self.flush_clock.lap("from_backup_stream", t)

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy host pages into device pages, at the next `before_compute` (which the caller runs before anything
        reads them): the loads issued until then cross the bus as one transfer and are scattered as one copy."""
        self.flush()  # (rule 4 needs every backup of these host pages gathered)
        t0 = self.clock.now()
        op = self._new_op(device_pages, host_pages, is_load=True)
        for i, h in enumerate(host_pages):  # (direct: a backup in flight runs before it on the compute stream)
            if self.copy != "direct" and (src := self._in_flight_backup(h)) is not None:
                self.pages_from_backups += 1
            elif (src := self._prefetched.get(h)) is not None:
                self.pages_from_prefetch += 1
            if src is not None:
                op.from_staging.append((i, *src))
        taken = {i for i, _, _ in op.from_staging}
        op.own = [i for i in range(len(host_pages)) if i not in taken]
        self._unjoined.append(op)
        self.pages_loaded += len(device_pages)
        self.clock.lap("load", t0)

    def filling(self, page: int) -> bool:
        """Whether a load not scattered yet fills pool page `page` (read it only after `before_compute`)."""
        return any(page in op.device_pages for op in self._unjoined)

    def prefetching(self, key: str) -> bool:
        return key in self._prefetches

    @property
    def prefetch_room(self) -> int:
        """Staging pages a new prefetch may take."""
        return self.prefetch_pages - self._prefetch_held

    def prefetch(self, key: str, host_pages: list[int], max_pages: int | None = None) -> int:
        """Start copying the host pages a waiting request will load into staging of their own, unless `key`
        has a prefetch already; leaves out pages prefetched already or whose backup is in flight (rule 4), and
        stops at `max_pages` and at the budget. Returns how many pages it prefetches. Its transfer queues on the
        tier stream like a load's (so a load's join, which waits for the tier stream up to that load, covers it),
        and a load issued after it waits for it: hence `max_pages`."""
        if key in self._prefetches:
            return 0
        self.flush()  # (a queued backup's host pages are in flight too)
        pages = [h for h in host_pages if self._prefetchable(h)]
        room = self.prefetch_room
        pages = pages[:max(0, room if max_pages is None else min(room, max_pages))]
        if not pages:
            return 0
        t0 = self.clock.now()
        self.issued += 1  # (its id until it is retired, for `land`)
        op = CopyOp(self.issued, [], pages, is_load=True, prefetch=True)
        self._hold(op, pages)
        with self.order.work("tier_prefetch"):
            op.staged = self._staging(len(pages))
            self._transfer(op, lambda: self._from_host(op))
        self._prefetches[key] = op
        for i, h in enumerate(pages):
            self._prefetched[h] = (op, i)
        self._prefetch_held += len(pages)
        self.pages_prefetched += len(pages)
        self.num_prefetches += 1
        self.clock.lap("prefetch", t0)
        return len(pages)

    def _prefetchable(self, host_page: int) -> bool:
        """Not prefetched already, and filled (no backup in flight: the prefetch would read it before it lands)."""
        return host_page not in self._prefetched and self._in_flight_backup(host_page) is None

    def retire(self, key: str) -> None:
        """The prefetch of `key` is no longer wanted (its request was admitted, or left): it joins the copies
        reaped in order, which releases its host pages once its transfer landed. A load that took pages from its
        staging keeps that alive."""
        op = self._prefetches.pop(key, None)
        if op is None:
            return
        self.flush()  # (the queued backups stay the last of `ops`)
        for h in op.host_pages:
            del self._prefetched[h]
        self._prefetch_held -= len(op.host_pages)
        self.issued += 1
        op.id, op.joined = self.issued, True
        self.ops.append(op)

    def retire_all(self) -> None:
        for key in list(self._prefetches):
            self.retire(key)

    def before_compute(self) -> None:
        """Issue every load since the last call as one copy: their host pages (those no prefetch or backup in
        flight holds) into one staging tensor on the tier stream, then one scatter into their pool pages on the
        compute stream after that transfer (rule 2): whatever the compute stream runs next reads them loaded. The
        loads' references on the pool pages go (rule 3: every later use of them runs on the compute stream, after
        the scatter)."""
        if not self._unjoined:
            return
        t0 = self.clock.now()
        ops, self._unjoined = self._unjoined, []
        if self.copy == "direct":
            self._load_direct(ops)
            self.num_loads += 1
            self.clock.lap("scatter", t0)
            return
        # (entered even with nothing to transfer: the join waits for it, so for every prefetch before it too)
        with self.order.work("tier_load"):
            staged = self._staging(sum(len(op.own) for op in ops))
            at = 0
            for op in ops:  # each load's own transfer, into its rows of the staging
                op.staged = tuple(None if t is None else t[at:at + len(op.own)] for t in staged)
                at += len(op.own)
                if op.own:
                    self._transfer(op, lambda op=op: self._from_host(op))
        t0 = self.clock.lap("load", t0)
        with self.order.work("tier_join"):  # (on CUDA: the compute stream waits for the transfer)
            for op in ops:
                self._await_transfer(op)
            self._scatter(ops, staged)
            done = self._done()
            for op in ops:
                self._drop_pool(op)
                op.joined, op.done = True, done
        self.num_loads += 1
        self.clock.lap("scatter", t0)

    def _load_direct(self, ops: list[CopyOp]) -> None:
        """The loads' own host pages straight into their pool pages, one launch, then the pages they take from
        prefetches' staging, one launch a prefetch, after the tier stream (which ran the prefetches): all on the
        compute stream, so whatever it runs next reads them loaded; the ring is sealed behind them."""
        with self.order.work("tier_load_direct"):
            self._move_in(self.moves.pool, [op.host_pages[i] for op in ops for i in op.own],
                          [op.device_pages[i] for op in ops for i in op.own])
        taken: dict[int, tuple[CopyOp, list[int], list[int]]] = {}
        for op in ops:
            for i, src, j in op.from_staging:
                _, rows, pages = taken.setdefault(id(src), (src, [], []))
                rows.append(j)
                pages.append(op.device_pages[i])
        if taken:
            with self.order.work("tier_take_prefetch"):
                for src, rows, pages in taken.values():
                    self._await_transfer(src)
                    self.moves.move(self.moves.staging(src.staged), self.moves.pool, rows, pages)
        done = self.moves.done()
        for op in ops:
            self._drop_pool(op)
            op.joined, op.done = True, done

    def _move_out(self, op: CopyOp, t: tuple[float, float]) -> tuple[float, float]:
        """Direct: a backup's pool pages into its host pages, one launch (`t`: where the flush's clock is)."""
        at = self.moves.ring.put(op.device_pages + op.host_pages)
        t = self.flush_clock.lap("index", t)
        self.moves.launch(self.moves.pool, self.moves.host, len(op.host_pages), at)
        self.num_transfers += 1
        return self.flush_clock.lap("transfer", t)

    def _move_in(self, dst, host_pages: list[int], pages: list[int]) -> None:
        """Direct: host pages into pages of store `dst` (the pool or a staging), one launch (none for no pages)."""
        if host_pages:
            self.moves.move(self.moves.host, dst, host_pages, pages)
            self.num_transfers += 1

    def _done(self) -> torch.cuda.Event | None:
        """An event after the work issued so far on the current stream (CUDA); with kernel launches, it seals the
        index ring's regions they read (their work precedes it: on this stream, or on one this stream waited for)."""
        if self.moves is not None:
            return self.moves.done()
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _await_transfer(self, op: CopyOp) -> None:
        """Deferred mode: the load's transfer lands before its scatter (on CUDA the join's edge does this)."""
        if op.pending is not None:
            op.pending, run = None, op.pending
            run()

    def _in_flight_backup(self, host_page: int) -> tuple[CopyOp, int] | None:
        """(the backup, the page's index in it) still filling `host_page`, if any (rule 4)."""
        return self._backing.get(host_page)

    def _new_op(self, device_pages: list[int], host_pages: list[int], is_load: bool) -> CopyOp:
        """A copy in issue order, holding the pages it touches (rule 3)."""
        self.issued += 1
        op = CopyOp(self.issued, list(device_pages), list(host_pages), is_load)
        self._hold_pool(op.device_pages)
        self._hold(op, op.host_pages)
        self.ops.append(op)
        return op

    def _hold(self, op: CopyOp, host_pages: list[int]) -> None:
        """Rule 3: the host pages `op` touches (of its `host_pages`) stay allocated until it is reaped."""
        self.incref(host_pages)

    def _unhold(self, op: CopyOp) -> None:
        self.decref(op.host_pages)

    def _hold_pool(self, device_pages: list[int]) -> None:
        """Rule 3: the pool pages a copy reads or fills (`op.device_pages`) stay allocated until its gather or
        scatter is issued (`_drop_pool`)."""
        self.pool.incref(device_pages)

    def _drop_pool(self, op: CopyOp) -> None:
        self.pool.decref(op.device_pages)
        op.device_pages = []

    def _release(self, op: CopyOp) -> None:
        """A reaped copy's references go."""
        self._drop_pool(op)
        self._unhold(op)
        if not op.is_load:
            for h in op.host_pages:
                if self._backing.get(h, (None,))[0] is op:
                    del self._backing[h]

    def _transfer(self, op: CopyOp, run: Callable) -> None:
        """Run a bus transfer on the current (side) stream: now on CUDA or CPU, later in deferred mode."""
        if self.cuda:
            run()
            if not op.is_load or op.prefetch:  # (a load's completion is its scatter's, on the compute stream)
                op.done = self._done()
        elif self.deferred:
            op.pending = run
        else:
            run()

    # ---- completion ------------------------------------------------------------------------------------
    def land(self, upto: int, stream: str | None = None) -> None:
        """Deferred mode: the transfers up to id `upto` land now, in issue order; with `stream` only those of that
        stream ("tier": loads and prefetches, "backup": backups), as the two streams run independently."""
        for op in sorted((*self.ops, *self._prefetches.values()), key=lambda op: op.id):
            if op.id > upto:
                break
            if op.pending is not None and stream in (None, "backup" if not op.is_load else "tier"):
                op.pending, run = None, op.pending
                run()

    def ready(self) -> int:
        """The id up to which every copy has completed: the reap point (rank 0 decides it, see rule 5)."""
        last = 0
        for op in self.ops:
            if (op is self._queued or op.pending is not None or (op.is_load and not op.joined)
                    or (op.done is not None and not op.done.query())):
                break
            last = op.id
        return last

    def reap(self, upto: int | None = None) -> None:
        """Flush the queued backups, wait for the copies up to id `upto` (every one if None) and drop the
        references they hold."""
        self.flush()
        while self.ops and (upto is None or self.ops[0].id <= upto):
            op = self.ops[0]
            assert not op.is_load or op.joined, "a load is reaped before its scatter (call before_compute)"
            if op.pending is not None or (op.done is not None and not op.done.query()):
                t0 = self.clock.now()
                self.land(op.id)
                if op.done is not None:
                    op.done.synchronize()
                self.waits += 1
                self.clock.lap("wait", t0)
            self.ops.popleft()
            self._release(op)

    @property
    def in_flight(self) -> int:
        return len(self.ops)
