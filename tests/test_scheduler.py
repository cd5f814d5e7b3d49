"""The scheduler driven directly, with no model: random arrivals, shared prefixes, a pool small enough to force
retractions, and aborts. Each simulated step does the scheduler's own bookkeeping as the engine core does
(`advance`, `resolve`, `finish`) and also plays the model's part on the KV pool: it
checks that the KV a chunk attends to holds exactly its request's tokens, then writes the chunk's own KV
(token + 1000 * position in the key, a digest of the prefix in the value, as in test_radix_cache).

With a host tier, copies run deferred (see test_host_tier): each step first lands a random number of them and
reaps those that landed, as the engine does, and fresh pages are poisoned, so KV that a load has not yet
brought back, or that a copy read from a reused page, shows up as wrong.
"""

import random
from collections import Counter

import pytest
import torch
from test_radix_cache import holds, kv_value, pinned_pages, tree_paths

from tandem.config import PRESETS, EngineConfig
from tandem.engine.host_tier import HostTier
from tandem.engine.kv_pool import KVPool
from tandem.engine.radix_cache import EVICT_FRACTION, RadixCache
from tandem.engine.request import Request, Status
from tandem.engine.scheduler import Chunk, Scheduler
from tandem.types import SamplingParams


class Sim:
    def __init__(self, num_pages=8, page_size=4, max_prefill_tokens=8, max_running_requests=4, prefix_cache=True,
                 seed=0, alphabet=4, host_pages=0, policy="write_through", device="cpu", stall_cycles=0,
                 prefetch_pages=None, copy="staged"):
        """`stall_cycles` (CUDA): the device sleeps this long at the start of every step, so that copies the
        host issues while it sleeps overlap compute that has not run yet."""
        self.pool = KVPool(PRESETS["tiny"], num_pages, page_size, torch.float32, device)
        self.stall_cycles = stall_cycles
        self.tier = HostTier(self.pool, host_pages, policy, deferred=True, copy=copy,
                             prefetch_pages=num_pages if prefetch_pages is None else prefetch_pages) \
            if host_pages else None
        self.cache = RadixCache(self.pool, self.tier) if prefix_cache else None
        alloc = self.pool.alloc

        def poisoned_alloc(n: int) -> list[int] | None:  # a fresh page holds anything
            pages = alloc(n)
            for p in pages or []:
                self.pool.k_cache[:, p * page_size:(p + 1) * page_size] = -1.0
            return pages

        self.pool.alloc = poisoned_alloc
        self.config = EngineConfig(page_size=page_size, num_pages=num_pages, max_prefill_tokens=max_prefill_tokens,
                                   max_running_requests=max_running_requests)
        self.sched = Scheduler(self.pool, self.cache, self.config)
        self.rng, self.alphabet = random.Random(seed), alphabet
        self.arrivals, self.requests, self.num_steps = 0, [], 0
        self.aborted: list[Request] = []

    @property
    def capacity(self) -> int:
        return self.pool.num_pages * self.pool.page_size

    def add(self, prompt: list[int], max_new_tokens: int) -> Request:
        assert len(prompt) + max_new_tokens - 1 <= self.capacity  # what Engine.validate guarantees
        req = Request(f"r{self.arrivals}", list(prompt), len(prompt), SamplingParams(max_new_tokens=max_new_tokens),
                      seed=0, arrival=self.arrivals)
        self.arrivals += 1
        self.requests.append(req)
        self.sched.waiting.append(req)
        return req

    @property
    def active(self) -> list[Request]:
        return self.sched.running + list(self.sched.waiting)

    def step(self) -> list[Chunk]:
        if self.stall_cycles:
            torch.cuda._sleep(self.stall_cycles)
        if self.tier is not None:
            if self.tier.ops:
                self.tier.land(self.tier.ops[self.rng.randrange(len(self.tier.ops))].id - self.rng.randrange(2),
                               self.rng.choice([None, "tier", "backup"]))  # (the tier's two streams run apart)
            self.tier.reap(self.tier.ready())
        oldest = self.sched.running[0] if self.sched.running else None
        chunks = self.sched.schedule()
        self.check_chunks(chunks, oldest)
        for c in chunks:
            self.check_kv_read(c)
        if self.stall_cycles:  # the writes below, and the backups after_step issues, queue behind a busy device
            torch.cuda._sleep(self.stall_cycles)
        for c in chunks:
            self.write_kv(c)
        self.sched.advance(chunks)
        self.sched.prefetch()  # (as the engine: once the step is launched)
        for c in chunks:  # the model's samples, as the engine applies them
            if c.sample and (reason := self.sched.resolve(c.req, len(c.req.tokens) - 1,
                                                          self.rng.randrange(self.alphabet), 0.0, 0)):
                self.sched.finish(c.req, reason)
        self.num_steps += 1
        self.check_accounting()
        return chunks

    # -- the claims ------------------------------------------------------------------------------------
    def check_chunks(self, chunks: list[Chunk], oldest: Request | None) -> None:
        reqs = [c.req for c in chunks]
        assert len(set(map(id, reqs))) == len(reqs), "a request scheduled twice in one step"
        assert chunks or not self.active, "requests are waiting but the step computes nothing"
        if oldest is not None:
            assert oldest in reqs, f"the oldest running request {oldest.rid} made no progress"
        assert len(self.sched.running) <= self.config.max_running_requests
        prefill = 0
        for c in chunks:
            req, P = c.req, self.pool.page_size
            assert req.status is Status.RUNNING and c.start == req.num_computed
            assert c.num_tokens >= 1 and c.start + c.num_tokens <= len(req.tokens)
            assert len(req.pages) * P >= c.start + c.num_tokens, "chunk runs past its pages"
            if len(req.tokens) - c.start > 1:  # a decode is one token and draws no budget
                prefill += c.num_tokens
        assert prefill <= self.config.max_prefill_tokens

    def check_kv_read(self, c: Chunk) -> None:
        """The KV of positions [0, start) that this chunk attends to is its own context's."""
        if c.start == 0:
            return
        slots = self.pool.slots(c.req.pages, 0, c.start)
        k, v = self.pool.k_cache[0, slots, 0, 0].tolist(), self.pool.v_cache[0, slots, 0, 0].tolist()
        for pos in range(c.start):
            assert (k[pos], v[pos]) == kv_value(c.req.tokens, pos), f"{c.req.rid}: wrong KV at position {pos}"

    def write_kv(self, c: Chunk) -> None:
        for pos in range(c.start, c.start + c.num_tokens):
            assert self.pool.refcount[c.req.pages[pos // self.pool.page_size]] >= 1
            slot = c.req.pages[pos // self.pool.page_size] * self.pool.page_size + pos % self.pool.page_size
            self.pool.k_cache[0, slot, 0, 0], self.pool.v_cache[0, slot, 0, 0] = kv_value(c.req.tokens, pos)

    def check_accounting(self) -> None:
        expected = [0] * self.pool.num_pages
        if self.cache is not None:
            self.cache.check_invariants()
            if self.tier is None:
                assert pinned_pages(self.cache) == [], "tree pages no request holds cannot be evicted"
                for tokens, pages in tree_paths(self.cache):
                    assert holds(self.pool, pages, tokens), f"the cache's KV for {tokens} is wrong"
            for node in self.cache._nodes():
                for p in node.pages:
                    if p is not None:
                        expected[p] += 1
        for op in self.tier.ops if self.tier is not None else ():
            for p in op.device_pages:
                expected[p] += 1
        for req in self.sched.running:
            assert len(set(req.pages)) == len(req.pages)
            for p in req.pages:
                expected[p] += 1
        for req in self.sched.waiting:
            assert req.status is Status.WAITING and req.pages == [] and req.num_computed == 0
        assert self.pool.refcount == expected, "a page's refcount differs from its holders"
        free = self.pool._free
        assert len(set(free)) == len(free) and sorted(free) == [p for p, n in enumerate(expected) if n == 0]

    def abort(self, req: Request) -> None:
        self.sched.remove(req)
        self.aborted.append(req)
        self.check_accounting()

    def check_drained(self) -> None:
        """Every request finished: aborted, or with all its tokens; retractions add up; no page leaked."""
        assert not self.active
        assert all(r.status is Status.FINISHED for r in self.requests)
        for r in self.requests:
            assert r in self.aborted or r.num_generated == r.sampling.max_new_tokens
        assert sum(r.num_retractions for r in self.requests) == self.sched.num_retractions
        if self.tier is not None:
            self.tier.reap()
        cached = self.cache.num_pages if self.cache is not None else 0
        assert self.pool.num_free + cached == self.pool.num_pages, "pages leaked"

    def run_until_done(self, max_steps: int) -> None:
        while self.active:
            assert self.num_steps < max_steps, f"not done after {max_steps} steps: livelock?"
            self.step()
        self.check_drained()


def random_workload(sim: Sim, num_requests: int, headroom_pages: int, abort_rate=0.03, max_steps=3000) -> None:
    """Requests arrive at random steps; prompts share prefixes of a few base sequences; some are aborted.
    Each request's prompt plus output leaves `headroom_pages` of the pool unused."""
    rng, capacity = sim.rng, sim.capacity - headroom_pages * sim.pool.page_size
    bases = [[rng.randrange(sim.alphabet) for _ in range(capacity)] for _ in range(3)]
    pending = num_requests
    while pending or sim.active:
        assert sim.num_steps < max_steps, f"not done after {max_steps} steps: livelock?"
        while pending and rng.random() < 0.4:
            max_new = rng.randint(1, max(1, capacity // 3))
            length = rng.randint(1, capacity + 1 - max_new)
            shared = rng.randint(0, length)
            prompt = rng.choice(bases)[:shared] + [rng.randrange(sim.alphabet) for _ in range(length - shared)]
            sim.add(prompt, max_new)
            pending -= 1
        if sim.active and rng.random() < abort_rate:
            sim.abort(rng.choice(sim.active))
        sim.step()
    sim.check_drained()
    if sim.cache is not None:  # with no request left, every cached page can be evicted
        cached = sim.cache.num_pages
        assert sim.cache.evict(sim.pool.num_pages) == cached or sim.tier is not None
        if sim.tier is not None:  # write_back: the evicted pages are free once their backups are reaped
            sim.tier.reap()
        assert sim.pool.num_free == sim.pool.num_pages and sim.cache.num_pages == 0


def run_random_scenarios(num_scenarios: int, headroom_pages: int, prefix_cache=True, **tier) -> Counter:
    """Random pool shapes (page sizes 1-4, up to 12 pages, budgets from 1 token, 1-6 running requests).
    Returns what the workloads exercised, summed over scenarios."""
    rng, totals = random.Random(headroom_pages), Counter()
    for scenario in range(num_scenarios):
        page_size, num_pages = rng.randint(1, 4), rng.randint(2 + headroom_pages, 12)
        shape = dict(num_pages=num_pages, page_size=page_size, max_prefill_tokens=rng.randint(1, 16),
                     max_running_requests=rng.randint(1, 6))
        sim = Sim(**shape, prefix_cache=prefix_cache, seed=scenario, **tier)
        try:
            random_workload(sim, num_requests=14, headroom_pages=headroom_pages)
        except AssertionError as e:
            raise AssertionError(f"scenario {scenario} {shape}, step {sim.num_steps}: {e}") from e
        totals["retractions"] += sim.sched.num_retractions
        totals["cached_tokens"] += sim.sched.num_cached_tokens
        totals["aborted"] += len(sim.aborted)
        totals["host_tokens"] += sim.sched.num_host_tokens
        if sim.tier is not None:
            totals["from_prefetch"] += sim.tier.pages_from_prefetch
            totals["from_backups"] += sim.tier.pages_from_backups
    return totals


@pytest.mark.parametrize("headroom_pages", [0, 1])
def test_random_workloads_finish_with_consistent_pages_and_kv(headroom_pages):
    """With no headroom some requests need every page of the pool: what exposed the two starvation bugs below."""
    totals = run_random_scenarios(100, headroom_pages=headroom_pages)
    # the workloads do exercise what they claim to
    assert totals["retractions"] > 50 and totals["cached_tokens"] > 1000 and totals["aborted"] > 20


def test_random_workloads_without_a_prefix_cache_finish_with_consistent_pages():
    run_random_scenarios(30, headroom_pages=0, prefix_cache=False)


def test_tiny_pool_retracts_the_newest_and_the_oldest_always_progresses():
    sim = Sim(num_pages=6, page_size=4, max_prefill_tokens=16, max_running_requests=4, seed=1)
    for i in range(4):
        sim.add([i] * 3, max_new_tokens=16)  # each alone needs 5 of the 6 pages by its end
    sim.run_until_done(max_steps=500)
    assert sim.sched.num_retractions > 0


def test_siblings_wait_for_a_shared_prefill_instead_of_recomputing_it():
    sim = Sim(num_pages=32, page_size=4, max_prefill_tokens=64, max_running_requests=8)
    prefix = list(range(20))
    reqs = [sim.add(prefix + [100 + i], max_new_tokens=2) for i in range(3)]
    sim.step()
    assert [r.status for r in reqs] == [Status.RUNNING, Status.WAITING, Status.WAITING]
    sim.run_until_done(max_steps=50)
    assert sorted(r.cached_tokens for r in reqs) == [0, 20, 20]


def test_max_running_requests_caps_admission():
    sim = Sim(num_pages=64, page_size=4, max_prefill_tokens=64, max_running_requests=2)
    for i in range(5):
        sim.add([i, i, i], max_new_tokens=4)
    sim.step()
    assert len(sim.sched.running) == 2 and len(sim.sched.waiting) == 3
    sim.run_until_done(max_steps=100)


def test_aborting_waiting_and_running_requests_frees_their_pages():
    sim = Sim(num_pages=10, page_size=4, max_prefill_tokens=6)
    a, b, c = (sim.add([i] * 9, max_new_tokens=5) for i in range(3))
    sim.step()
    assert a.status is Status.RUNNING and c.status is Status.WAITING
    sim.abort(a)  # mid-prefill
    sim.abort(c)  # still queued
    sim.sched.remove(c)  # twice: a no-op
    sim.check_accounting()
    sim.run_until_done(max_steps=100)
    assert a.status is c.status is Status.FINISHED and b.num_generated == 5


def test_a_request_that_needs_the_whole_pool_is_not_starved_by_its_own_duplicate_page():
    """A running request that kept its own copy of a page the tree holds, with its later pages inserted below
    the tree's copy, pinned that copy (eviction trims leaf tails only): needing the whole pool, it never got
    the page, stopped progressing, and the engine spun forever. Publishing must switch it to the tree's copy."""
    # R's first prefill chunk (budget 6) publishes R[:6], ending inside page 1. Next step R's last chunk and Q
    # (sharing 8 tokens with R: too few to wait for R) both compute positions 6-7, each into its own page 1.
    # The tree keeps R's page 1 and hangs Q's page 2 below it; R finishes. Q needs all 5 pages of the pool
    # but holds its own copy of page 1, and the tree's copy cannot be evicted while Q holds page 2.
    sim = Sim(num_pages=5, page_size=4, max_prefill_tokens=6, max_running_requests=4)
    r = sim.add(list(range(10, 18)), max_new_tokens=1)
    sim.step()
    q = sim.add(r.tokens[:8] + list(range(30, 42)), max_new_tokens=1)  # 20 tokens: all 5 pages
    sim.run_until_done(max_steps=20)
    assert q.status is Status.FINISHED


def test_a_request_that_needs_the_whole_pool_is_admitted_after_a_partial_match():
    """Admission holds the partially matched page while it allocates the fresh ones, one page more than a
    request needing the whole pool (which validation allows) can have: it was never admitted, even with
    nothing running, and the engine spun forever."""
    sim = Sim(num_pages=2, page_size=4, max_prefill_tokens=16)
    sim.add([1, 2, 3], max_new_tokens=1)
    sim.run_until_done(max_steps=10)  # leaves [1, 2, 3] cached: a partial page
    b = sim.add([1, 2, 3, 4, 5, 6, 7, 8], max_new_tokens=1)  # 8 tokens of KV: both pages
    sim.run_until_done(max_steps=10)
    assert b.num_generated == 1


def test_without_a_prefix_cache_siblings_are_admitted_at_once():
    """Nothing lands in a cache that is not there: waiting for a sibling's prefill would only delay them."""
    sim = Sim(num_pages=32, page_size=4, max_prefill_tokens=64, max_running_requests=8, prefix_cache=False)
    prefix = list(range(20))
    reqs = [sim.add(prefix + [100 + i], max_new_tokens=2) for i in range(3)]
    sim.step()
    assert all(r.status is Status.RUNNING for r in reqs)


def test_a_request_switched_to_the_trees_pages_reads_them_from_its_page_array():
    """After a prefill chunk the scheduler switches a request to the tree's copies of pages it computed twice
    (adopt); the block tables the GPU path builds come from the request's cached page array, which must follow."""
    sim = Sim(num_pages=16, page_size=4)
    tokens = list(range(12))
    owner = sim.add(tokens + [99], max_new_tokens=1)
    sim.run_until_done(max_steps=20)  # the tree now holds pages for tokens
    twin = Request("twin", tokens + [7], 13, SamplingParams(max_new_tokens=4), seed=0, arrival=99)
    twin.pages, twin.num_computed, twin.status = sim.pool.alloc(4), 12, Status.RUNNING
    sim.sched.running.append(twin)
    before = list(twin.page_array())  # built while its own duplicates were its pages
    sim.sched._publish_prefixes([Chunk(twin, 0, 12)])
    assert twin.pages[:3] != before[:3] and owner.status is Status.FINISHED  # it did switch to the tree's pages
    assert list(twin.page_array()) == twin.pages


def test_an_export_whose_token_is_in_flight_is_not_retracted_for_another_request():
    """A prefill server's request whose prompt is computed and whose one token is in flight ends at the next step's
    result with its pages exported: a decode that needs a page waits a step rather than retracting it (which
    would lose the export; a pinned export's pages would not even come free). Without an export, the newest is
    retracted as before."""
    from tandem.engine.scheduler import PENDING

    for export in (0, None):
        pool = KVPool(PRESETS["tiny"], 4, 4, torch.float32, "cpu")
        sched = Scheduler(pool, None, EngineConfig(page_size=4, num_pages=4))
        old = Request("old", [1] * 4 + [5], 4, SamplingParams(max_new_tokens=8), seed=0, arrival=0)
        new = Request("new", [2] * 11 + [PENDING], 11, SamplingParams(max_new_tokens=1), seed=0, arrival=1)
        for req, pages in ((old, 1), (new, 3)):  # (old decodes into a second page; new holds the other three)
            req.pages, req.num_computed, req.status = pool.alloc(pages), len(req.tokens) - 1, Status.RUNNING
            sched.running.append(req)
        new.export_kv_from = export
        chunks = sched.schedule()
        if export is not None:
            assert new.status is Status.RUNNING and new.num_retractions == 0 and old.status is Status.RUNNING
            assert not chunks and pool.num_free == 0
        else:
            assert new.status is Status.WAITING and new.num_retractions == 1 and [c.req for c in chunks] == [old]


def test_requests_growing_a_page_at_a_time_evict_a_share_of_the_pool_at_once():
    """With the pool full of cached prefixes, decodes that take a page at a time make each eviction free at least
    `EVICT_FRACTION` of the pool: every eviction walks the cache's whole tree, which they would otherwise do for
    every page they take."""
    sim = Sim(num_pages=2048, page_size=4, max_prefill_tokens=4096, max_running_requests=64)
    sim.check_accounting = lambda: None  # (the other tests check it; over 2,048 cached pages every step it is slow)
    for i in range(60):  # distinct prompts of 32 pages, cached once done
        sim.add([10_000 * (i + 1) + j for j in range(128)], max_new_tokens=1)
    sim.run_until_done(max_steps=200)
    assert sim.pool.num_free <= 128, sim.pool.num_free
    calls, evict = [], sim.cache.evict
    sim.cache.evict = lambda n: calls.append(n) or evict(n)
    for i in range(8):
        sim.add([i], max_new_tokens=200)  # 51 pages each by the end, taken one at a time
    sim.run_until_done(max_steps=1000)
    batch = int(2048 * EVICT_FRACTION)
    assert batch > 1 and calls and min(calls) >= batch, calls
    assert len(calls) <= 8 * 51 // batch + 2, len(calls)  # (a page at a time: one call for each of ~280 pages)


def test_backups_into_a_full_host_tier_free_a_share_of_it_at_once():
    """With the host tier full, inserts that back up a page or two each (write-through: a finished turn's new pages)
    make each of the tier's evictions free at least `EVICT_FRACTION` of it: each walks the whole tree, which they
    would otherwise do for every insert."""
    sim = Sim(num_pages=4096, page_size=4, max_prefill_tokens=4096, max_running_requests=64, host_pages=2048)
    sim.check_accounting = lambda: None  # (as above)
    prompts = [[10_000 * (i + 1) + j for j in range(128)] for i in range(66)]  # distinct, of 32 pages
    for p in prompts:  # cached (the device holds them all) and backed up: the tier fills
        sim.add(p, max_new_tokens=1)
    sim.run_until_done(max_steps=300)
    assert sim.tier.num_free < 8, sim.tier.num_free
    calls, evict_host = [], sim.cache.evict_host
    sim.cache.evict_host = lambda n: calls.append(n) or evict_host(n)
    for i, p in enumerate(prompts[-64:]):  # the next turns: each adds 2 pages to a cached history
        sim.add(p + [5_000_000 + i] * 8, max_new_tokens=1)
    sim.run_until_done(max_steps=300)
    batch = int(2048 * EVICT_FRACTION)
    assert batch > 2 and calls and min(calls) >= batch, calls
    assert len(calls) <= 64 * 3 // batch + 4, len(calls)  # (an insert at a time: about 64 calls)
