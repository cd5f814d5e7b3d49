"""Admission's evictions: an eviction that freed nothing is not repeated until a page is released (`pool.releases`),
since it would free nothing again; a release makes the next admission evict again. The mutant that never evicts
again after a fruitless eviction leaves a waiting request waiting for good."""

import pytest
from test_scheduler import Sim, run_random_scenarios

from tandem.engine.kv_pool import PageAllocator
from tandem.engine.scheduler import Scheduler


def _frozen_releases(monkeypatch) -> None:
    """The mutant: a fruitless eviction is never retried (as if no page were ever released)."""
    monkeypatch.setattr(Scheduler, "alloc", _alloc_never_retrying)


def _alloc_never_retrying(self, n, reserve=0):
    short = n + reserve - self.pool.num_free
    if short > 0 and self.cache is not None and self._fruitless_at is None and self.cache.evict(short) == 0:
        self._fruitless_at = self.pool.releases
    if self.pool.num_free - reserve < n:
        return None
    return self.pool.alloc(n)


@pytest.mark.parametrize("mutant", [False, True])
def test_a_fruitless_eviction_is_retried_only_after_a_release(monkeypatch, mutant):
    if mutant:
        _frozen_releases(monkeypatch)
    sim = Sim(num_pages=8, page_size=4, max_prefill_tokens=64, max_running_requests=4)
    calls = []
    evict = sim.cache.evict
    sim.cache.evict = lambda n: (calls.append(n), evict(n))[1]
    first = sim.add(list(range(20)), max_new_tokens=8)  # 5 pages, 7 at its longest: none evictable while it runs
    sim.step()
    second = sim.add([3] * 16, max_new_tokens=2)  # 4 pages and one to spare: does not fit beside it
    for _ in range(5):
        sim.step()
    assert first.status.name == "RUNNING" and second in sim.sched.waiting
    assert len(calls) == 1, "one eviction found nothing; nothing was released since: no other"
    if mutant:
        with pytest.raises(AssertionError, match="waiting but the step computes nothing|livelock"):
            sim.run_until_done(max_steps=60)
        return
    sim.run_until_done(max_steps=60)  # the first finishes and releases its pages: the second is admitted
    assert len(calls) >= 2 and second.num_generated == 2


def test_decref_counts_pages_left_with_one_reference_or_none():
    a = PageAllocator(4, 4)
    pages = a.alloc(2)
    a.incref(pages)
    assert a.releases == 0
    a.decref([pages[0]])  # 2 -> 1: evictable if the cache holds it
    assert a.releases == 1
    a.decref(pages)  # 1 -> 0 and 2 -> 1
    assert a.releases == 3 and a.num_free == 3


@pytest.mark.parametrize("host_pages", [0, 12])
def test_random_workloads_never_livelock_and_keep_every_kv_right(host_pages):
    """The scheduler's random workloads (tight pools, shared prefixes, aborts), with and without a host tier:
    every request finishes, every read sees the right KV."""
    run_random_scenarios(30, headroom_pages=0, host_pages=host_pages, policy="write_through")
