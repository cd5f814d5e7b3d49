"""The host tier under the radix cache: a stateful model of requests, evictions and copies that land late, the
scheduler driven through random workloads with the tier, and the mutants each ordering rule exists for.

Copies run in deferred mode: a copy lands only when the model says so (or when it is reaped, which waits for
it), and it copies whatever the source holds at that moment. A page freed and reused while a copy still
used it, or a page read before its load landed, then holds the wrong KV, which the checks read back (the KV
of every computed token encodes its position and prefix, see test_radix_cache).
"""

import asyncio
import math
from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import Phase, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from test_radix_cache import P, extend_request, holds, kv_value, tokens_strategy, write
from test_scheduler import Sim, run_random_scenarios

from tandem.config import PRESETS, EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.host_tier import HostTier
from tandem.engine.kv_pool import KVPool
from tandem.engine.radix_cache import RadixCache
from tandem.engine.streams import MUTANT_ENV
from tandem.types import SamplingParams

NUM_PAGES, HOST_PAGES, MAX_REQUESTS = 6, 10, 2  # a device pool smaller than two long requests: pressure


@dataclass
class Req:
    tokens: list[int]
    pages: list[int] = field(default_factory=list)


class TierModel(RuleBasedStateMachine):
    """Requests admit (device hits, host loads, partial copies, compute), extend, publish, release; the cache
    evicts from both tiers; copies land and are reaped at arbitrary points; the cache resets."""

    policy = "write_through"
    copy = "staged"

    @initialize()
    def start(self):
        self.num_loads = 0
        self.pool = KVPool(PRESETS["tiny"], NUM_PAGES, P, torch.float32, "cpu")
        self.tier = HostTier(self.pool, HOST_PAGES, self.policy, deferred=True, copy=self.copy)
        self.cache = RadixCache(self.pool, self.tier)
        self.requests: list[Req] = []
        self.seen: list[list[int]] = []  # sequences given to the cache: hits on them exercise loads

    def _alloc(self, n: int) -> list[int] | None:
        if n > self.pool.num_free:
            self.cache.evict(n - self.pool.num_free)
        if n > self.pool.num_free and self.tier.in_flight:
            self.tier.reap()
            self.cache.evict(n - self.pool.num_free)
        pages = self.pool.alloc(n)
        for p in pages or []:  # a fresh page holds anything: never what a late copy was meant to bring
            self.pool.k_cache[:, p * P:(p + 1) * P] = self.pool.v_cache[:, p * P:(p + 1) * P] = -1.0
        return pages

    @rule(tokens=tokens_strategy)
    def admit(self, tokens):
        if len(self.requests) >= MAX_REQUESTS:  # the oldest finishes first, so that most admissions fit
            self.release(0, keep=True)
        m = self.cache.match(tokens)
        held = [p for p in m.pages if p is not None] + ([m.partial_page] if m.partial_page is not None else [])
        host = m.host_pages
        self.pool.incref(held)
        self.tier.incref(host)
        fresh = self._alloc(-(-len(tokens) // P) - len(m.pages) + len(host))
        if fresh is None:
            self.pool.decref(held)
            self.tier.decref(host)
            return
        table = m.pages
        if host:
            table = self.cache.load(m, fresh)
            self.tier.before_compute()
            fresh = fresh[len(m.loads):]
        self.tier.decref(host)
        if m.partial_page is not None:
            self.pool.copy_slots(m.partial_page, fresh[0], m.partial_len)
            self.pool.decref([m.partial_page])
        req = Req(list(tokens), table + fresh)
        self.num_loads += bool(host)
        assert holds(self.pool, req.pages, tokens, m.num_tokens), "a request reads KV before its load landed"
        write(self.pool, req.pages, req.tokens, m.num_tokens, len(tokens))
        self.requests.append(req)

    @precondition(lambda self: self.seen)
    @rule(i=st.integers(0, 100), more=st.lists(st.integers(0, 2), max_size=3))
    def revisit(self, i, more):
        """The next turn of a conversation the cache has seen."""
        self.admit(self.seen[i % len(self.seen)] + more)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100), more=st.lists(st.integers(0, 2), max_size=3), settle=st.booleans())
    def next_turn(self, i, more, settle):
        """A turn ends, pressure pushes its KV off the device, and the next turn of the same conversation comes."""
        tokens = self.requests[i % len(self.requests)].tokens
        self.release(i, keep=True)
        self.evict(NUM_PAGES, settle)
        self.admit(tokens + more)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100), more=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def extend(self, i, more):
        extend_request(self, i, more)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100))
    def publish(self, i):
        req = self.requests[i % len(self.requests)]
        self.cache.adopt(req.pages, self.cache.insert(req.tokens, req.pages))
        self.seen.append(list(req.tokens))

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100), keep=st.booleans())
    def release(self, i, keep):
        req = self.requests.pop(i % len(self.requests))
        if keep:
            self.cache.insert(req.tokens, req.pages)
            self.seen.append(req.tokens)
        self.pool.decref(req.pages)

    @rule(n=st.integers(1, NUM_PAGES), settle=st.booleans())
    def evict(self, n, settle):
        """As in the engine's scheduling: after reaping the copies that landed (or, with `settle`, all)."""
        self.tier.reap(None if settle else self.tier.ready())
        self.cache.evict(n)

    @rule(n=st.integers(1, HOST_PAGES))
    def evict_host(self, n):
        self.cache.evict_host(n)

    @precondition(lambda self: self.tier.in_flight)
    @rule(k=st.integers(1, 6))
    def land(self, k):
        self.tier.land(self.tier.ops[min(k, len(self.tier.ops)) - 1].id)

    @rule()
    def reap_landed(self):
        self.tier.reap(self.tier.ready())

    @rule()
    def reap_all(self):
        self.tier.reap()

    @rule()
    def reset(self):
        self.cache.reset()

    @invariant()
    def references_match_holders(self):
        """Device pages: the tree, requests and copies in flight hold them; host pages: the tree and copies.
        Nothing a copy still uses is free; host usage stays within the pool."""
        self.cache.check_invariants()
        device, host = [0] * NUM_PAGES, [0] * HOST_PAGES
        for node in self.cache._nodes():
            for p, h in zip(node.pages, node.host, strict=True):
                if p is not None:
                    device[p] += 1
                if h is not None:
                    host[h] += 1
        for req in self.requests:
            for p in req.pages:
                device[p] += 1
        for op in self.tier.ops:
            for p in op.device_pages:
                device[p] += 1
            for h in op.host_pages:
                host[h] += 1
        assert self.pool.refcount == device and self.tier.refcount == host
        assert sorted(self.pool._free) == [p for p, n in enumerate(device) if n == 0]
        assert sorted(self.tier._free) == [h for h, n in enumerate(host) if n == 0]

    @invariant()
    def every_holder_reads_its_own_kv(self):
        """Requests and tree pages on the device hold their KV; a host copy holds it once its backup landed."""
        for req in self.requests:
            assert holds(self.pool, req.pages, req.tokens)
        landing = {h for op in self.tier.ops if op.pending is not None or op is self.tier._queued  # (not flushed)
                   for h in op.host_pages}
        loading = {p for op in self.tier.ops if op.pending is not None and op.is_load for p in op.device_pages}
        for node, tokens, offset in nodes_with_paths(self.cache):
            for j, (p, h) in enumerate(zip(node.pages, node.host, strict=True)):
                start = offset + j * P
                if p is not None and p not in loading:
                    assert page_holds(self.pool, p, tokens, start), f"device page {p} of {tokens} is wrong"
                if h is not None and h not in landing:
                    assert host_holds(self.tier, h, tokens, start), f"host page {h} of {tokens} is wrong"


def page_holds(pool: KVPool, p: int, tokens: list[int], start: int) -> bool:
    """Whether device page `p` holds the KV of positions [start, start + P) of `tokens` (as far as they go)."""
    n = min(len(tokens) - start, P)
    k, v = pool.k_cache[0, p * P:p * P + n, 0, 0].tolist(), pool.v_cache[0, p * P:p * P + n, 0, 0].tolist()
    return all((k[i], v[i]) == kv_value(tokens, start + i) for i in range(n))


def host_holds(tier: HostTier, h: int, tokens: list[int], start: int) -> bool:
    k, v = tier.kv[h, 0, 0, :, 0, 0].tolist(), tier.kv[h, 1, 0, :, 0, 0].tolist()
    return all((k[i], v[i]) == kv_value(tokens, start + i) for i in range(min(len(tokens) - start, P)))


def nodes_with_paths(cache: RadixCache):
    """(node, tokens from the root through it, where it starts in them) for every node."""
    stack = [(c, []) for c in cache.root.children]
    while stack:
        node, prefix = stack.pop()
        tokens = prefix + node.tokens
        yield node, tokens, len(prefix)
        stack += [(c, tokens) for c in node.children]


class WriteBackModel(TierModel):
    policy = "write_back"


SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None, derandomize=True,
                    report_multiple_bugs=False)


def run_model(model: type[TierModel], max_examples: int = 150, shrink: bool = True) -> int:
    """Run the state machine; returns how many admissions loaded pages back (so a test can tell that the
    examples reached the interesting states, not only that nothing failed)."""
    loads = 0

    class Counted(model):
        def teardown(self):
            nonlocal loads
            loads += self.num_loads

    phases = SETTINGS.phases if shrink else [Phase.generate]  # a mutant's test only needs to see it fail
    run_state_machine_as_test(Counted, settings=settings(SETTINGS, max_examples=max_examples, phases=phases))
    return loads


@pytest.mark.parametrize("model", [TierModel, WriteBackModel])
def test_random_event_sequences_keep_pools_tree_and_kv_consistent(model):
    assert run_model(model) >= 20


# -- mutants: drop one ordering rule and the model must catch it ---------------------------------------------
def test_a_load_reading_a_host_page_its_backup_has_not_filled_is_caught(monkeypatch):
    monkeypatch.setattr(HostTier, "_in_flight_backup", lambda self, h: None)
    with pytest.raises(AssertionError, match="reads KV before its load landed|wrong"):
        run_model(WriteBackModel, max_examples=300, shrink=False)


def test_a_load_read_before_it_completes_is_caught(monkeypatch):
    monkeypatch.setattr(HostTier, "_await_transfer", lambda self, op: None)  # scatter unlanded
    with pytest.raises(AssertionError, match="reads KV before its load landed"):
        run_model(TierModel, max_examples=300, shrink=False)


# -- the scheduler with the tier: random workloads, pools small enough to evict and load back all the time ---
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_random_workloads_with_a_host_tier_load_back_and_keep_pages_and_kv_consistent(policy):
    """Loads from the host, from prefetches and (write_back) from backups in flight, with the tier's two streams
    landing in any order."""
    totals = run_random_scenarios(60, headroom_pages=0, host_pages=12, policy=policy)
    assert totals["host_tokens"] > 300 and totals["retractions"] > 20 and totals["from_prefetch"] > 100
    assert totals["from_backups"] > 0 or policy == "write_through"


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_prefetched_host_page_freed_and_rewritten_under_its_prefetch_is_caught(monkeypatch, policy):
    """A prefetch holds its host pages (rule 3): without, the tree frees one, a backup rewrites it, and a load of
    the new content takes the prefetch's stale copy."""
    hold, unhold = HostTier._hold, HostTier._unhold
    monkeypatch.setattr(HostTier, "_hold", lambda self, op, pages: None if op.prefetch else hold(self, op, pages))
    monkeypatch.setattr(HostTier, "_unhold", lambda self, op: None if op.prefetch else unhold(self, op))
    with pytest.raises(AssertionError, match="wrong KV"):
        run_random_scenarios(60, headroom_pages=0, host_pages=12, policy=policy)


def test_a_prefetch_of_a_host_page_whose_backup_is_in_flight_is_caught(monkeypatch):
    """A prefetch leaves out host pages still being backed up (rule 4): without, its transfer may land first."""
    monkeypatch.setattr(HostTier, "_prefetchable", lambda self, h: h not in self._prefetched)
    with pytest.raises(AssertionError, match="wrong KV"):
        run_random_scenarios(60, headroom_pages=0, host_pages=12, policy="write_back")


def test_a_partial_page_copied_from_a_page_a_load_still_fills_is_caught(monkeypatch):
    """A schedule's loads are scattered together at its end; an admission that copies a partially matched page an
    earlier admission's load fills must have the loads scattered first (`HostTier.filling`)."""
    monkeypatch.setattr(HostTier, "filling", lambda self, page: False)
    with pytest.raises(AssertionError, match="wrong KV"):
        run_random_scenarios(60, headroom_pages=0, host_pages=12, policy="write_through")


def test_the_scheduler_reading_a_load_before_it_completes_is_caught(monkeypatch):
    monkeypatch.setattr(HostTier, "_await_transfer", lambda self, op: None)  # scatter unlanded
    with pytest.raises(AssertionError, match="wrong KV"):
        run_random_scenarios(60, headroom_pages=0, host_pages=12, policy="write_through")


def test_a_next_turn_loads_its_history_back_from_the_host():
    sim = Sim(num_pages=8, page_size=4, max_prefill_tokens=64, max_running_requests=4, host_pages=16)
    first = sim.add(list(range(20)), max_new_tokens=4)
    sim.run_until_done(max_steps=50)
    other = sim.add(list(range(100, 124)), max_new_tokens=4)  # needs 7 of the 8 pages: evicts the first
    sim.run_until_done(max_steps=50)
    assert sim.cache.match(first.tokens).loads, "the first conversation's pages should be on the host only"
    second = sim.add(first.tokens + [7, 7], max_new_tokens=2)
    sim.run_until_done(max_steps=50)
    # everything the first request computed comes back: one page never left the device, four full pages and the
    # partial last one (3 tokens) from the host
    computed = len(first.tokens) - 1  # its last sampled token never went through the model
    assert (second.cached_tokens, second.host_cached_tokens) == (computed, computed - 4)
    assert other.host_cached_tokens == 0


# -- the engine: outputs unchanged by the tier, recomputation against the ideal ------------------------------
def agent_turns(config: EngineConfig, episodes=6, turns=4, seed=0):
    """`episodes` concurrent greedy multi-turn conversations: each turn resubmits the whole history plus new
    "tool output". Returns every turn's output and the engine's stats."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(2, 500, (n,), generator=gen).tolist()

    sp = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    starts = [tokens(40 + 13 * e) for e in range(episodes)]
    tools = [[tokens(5 + 3 * t) for t in range(turns)] for _ in range(episodes)]
    with Engine("tiny", config) as engine:
        async def episode(e):
            history, outs = starts[e], []
            for t in range(turns):
                out = await engine.generate(history, sp)
                outs.append(out)
                history = history + out.output_ids + tools[e][t]
            return outs

        async def everything():
            return await asyncio.gather(*[episode(e) for e in range(episodes)])

        outs = asyncio.run(everything())
        stats = asyncio.run(engine.get_stats())
    return [o for episode_outs in outs for o in episode_outs], stats


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_greedy_multi_turn_episodes_are_identical_with_the_tier_on_and_off(policy):
    small = dict(page_size=4, num_pages=48, max_prefill_tokens=64)  # about a quarter of the working set
    off, stats_off = agent_turns(EngineConfig(**small))
    on, stats_on = agent_turns(EngineConfig(**small, host_cache=policy, host_cache_pages=256,
                                            measure_ideal_reuse=True))
    assert [o.output_ids for o in on] == [o.output_ids for o in off]
    assert sum((o.output_logprobs for o in on), []) == pytest.approx(sum((o.output_logprobs for o in off), []),
                                                                     abs=1e-5)
    assert stats_on.prefill_tokens_host > 0 and stats_on.host_pages_loaded > 0
    assert stats_on.prefill_tokens_computed < stats_off.prefill_tokens_computed
    for o in on:
        meta = o.meta_info()
        assert meta["cached_tokens_details"]["device"] + meta["cached_tokens_details"]["host"] == o.cached_tokens
        assert o.cached_tokens < o.prompt_tokens
    assert stats_on.prompt_tokens_cached <= stats_on.prompt_tokens_ideal < stats_on.prompt_tokens


@pytest.mark.parametrize("mutant", [False, True])
def test_backups_batched_per_step_and_loads_of_scattered_host_pages_keep_outputs_identical(monkeypatch, mutant):
    """Backups of several requests in one step go out as one copy (one gather, one transfer), so do the loads of
    several admissions (one transfer, one scatter), and a host tier much
    smaller than the history is full, so host pages are evicted and reused and a load's pages are scattered runs:
    the outputs equal the tier off. The mutant gathers a batch's pages rotated by one (rows misaligned with their
    host pages), which must show."""
    calls, loads = [], []
    backup, load, gather = HostTier.backup, HostTier.load, HostTier._gather
    monkeypatch.setattr(HostTier, "backup", lambda self, d, h: (calls.append(len(h)), backup(self, d, h)))
    monkeypatch.setattr(HostTier, "load", lambda self, h, d: (loads.append(len(h)), load(self, h, d)))
    if mutant:
        monkeypatch.setattr(HostTier, "_gather", lambda self, pages, t: gather(self, pages[1:] + pages[:1], t))
    small = dict(page_size=4, num_pages=48, max_prefill_tokens=64)
    off, _ = agent_turns(EngineConfig(**small), episodes=8, turns=3)
    tiers = []
    init = HostTier.__init__
    monkeypatch.setattr(HostTier, "__init__", lambda self, *a, **k: (init(self, *a, **k), tiers.append(self))[0])
    on, stats = agent_turns(EngineConfig(**small, host_cache="write_through", host_cache_pages=96), episodes=8,
                            turns=3)
    tier = tiers[0]
    assert len(calls) > tier.num_backups + 5, "several requests' backups should share a flush"
    assert len(loads) > tier.num_loads, "several admissions' loads should share a copy"
    assert tier.num_transfers > tier.num_loads + tier.num_prefetches + tier.num_backups + 10, \
        "copies should take several runs of host pages"
    assert stats.host_pages_loaded > 50 and sum(calls) > tier.num_pages  # the tier filled up and reused pages
    assert ([o.output_ids for o in on] == [o.output_ids for o in off]) != mutant


def test_ideal_reuse_is_what_was_computed_before():
    """Every later turn could ideally reuse everything the previous turn computed; with a pool that holds it
    all the cache serves exactly that. The measurement is off unless asked for."""
    outs, stats = agent_turns(EngineConfig(page_size=4, num_pages=1024, measure_ideal_reuse=True), episodes=1,
                              turns=3)
    for first, later in ((outs[0], outs[1]), (outs[1], outs[2])):
        assert later.cached_tokens == first.prompt_tokens + len(first.output_ids) - 1
    assert stats.prompt_tokens_ideal == sum(o.cached_tokens for o in outs) > 0 and stats.reuse_vs_ideal == 1.0
    _, unmeasured = agent_turns(EngineConfig(page_size=4, num_pages=1024), episodes=1, turns=3)
    assert not unmeasured.ideal_measured and unmeasured.prompt_tokens_ideal == 0
    assert math.isnan(unmeasured.reuse_vs_ideal)


def test_host_cache_config_is_checked():
    with pytest.raises(ValueError, match="host_cache"):
        EngineConfig(host_cache="write_around")
    with pytest.raises(ValueError, match="enable_prefix_cache"):
        EngineConfig(host_cache="write_through", enable_prefix_cache=False)
    with pytest.raises(ValueError, match="host_cache_pages"):
        EngineConfig(host_cache_pages=-1)


# -- on a GPU: real streams, copies forced to overlap compute ------------------------------------------------
STALL = dict(device="cuda", stall_cycles=1_000_000)  # the device sleeps ~0.5 ms before each step's reads and writes


def slow_transfers(monkeypatch) -> None:
    """Every bus transfer starts after its side stream sleeps: a load's or backup's four steps' stalls, a
    prefetch's twenty (past the next steps, when its request may be admitted): transfers land late."""
    transfer = HostTier._transfer

    def slow(self, op, run):
        torch.cuda._sleep(STALL["stall_cycles"] * (20 if op.prefetch else 4))  # (on the transfer's side stream)
        transfer(self, op, run)

    monkeypatch.setattr(HostTier, "_transfer", slow)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("slow", [False, True])
def test_gpu_copies_overlapping_compute_keep_every_kv_right(monkeypatch, policy, slow):
    """Thousands of steps of random workloads; every read checks the KV it attends to. Transfers slower than
    steps (`slow`) make loads, prefetches and backups land after the compute issued behind them."""
    if slow:
        slow_transfers(monkeypatch)
    totals = run_random_scenarios(40, headroom_pages=0, host_pages=12, policy=policy, **STALL)
    assert totals["host_tokens"] > 200 and totals["from_prefetch"] > 0


@pytest.mark.gpu
def test_gpu_a_copy_not_waiting_for_compute_is_caught(monkeypatch):
    monkeypatch.setenv(MUTANT_ENV, "copies_before_compute")  # the pool touched off the compute stream
    with pytest.raises(AssertionError, match="wrong KV"):
        run_random_scenarios(40, headroom_pages=0, host_pages=12, policy="write_through", **STALL)


@pytest.mark.gpu
@pytest.mark.parametrize("mutant", ["load_not_joined", "prefetch_on_another_stream"])
def test_gpu_a_load_read_before_it_completes_is_caught(monkeypatch, mutant):
    monkeypatch.setenv(MUTANT_ENV, mutant)  # the scatter not waiting for a load's or a prefetch's transfer
    slow_transfers(monkeypatch)
    with pytest.raises(AssertionError, match="wrong KV"):
        run_random_scenarios(40, headroom_pages=0, host_pages=12, policy="write_through", **STALL)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_gpu_greedy_multi_turn_episodes_are_identical_with_the_tier_on_and_off(policy):
    small = dict(page_size=4, num_pages=48, max_prefill_tokens=64, device="cuda")
    off, _ = agent_turns(EngineConfig(**small))
    on, stats_on = agent_turns(EngineConfig(**small, host_cache=policy, host_cache_pages=256,
                                            measure_ideal_reuse=True))
    assert stats_on.host_pages_loaded > 0
    assert [o.output_ids for o in on] == [o.output_ids for o in off]


def test_flushing_an_idle_engine_frees_every_page_its_copies_held():
    """Copies hold their device and host pages until reaped, which a step does; an idle engine takes none, so the
    flush reaps them: afterwards both pools are whole."""
    with Engine("tiny", EngineConfig(page_size=4, num_pages=64, host_cache="write_through",
                                     host_cache_pages=128)) as engine:
        asyncio.run(engine.generate(list(range(2, 40)), SamplingParams(max_new_tokens=3, temperature=0)))
        asyncio.run(engine.flush_cache())
        s = asyncio.run(engine.get_stats())
    assert (s.pages_free, s.host_pages_free) == (s.pages_total, s.host_pages_total)
