"""The host tier's ordering rules one at a time, each with the mutant that breaks it: a copy lands late (deferred
mode) and the two side streams land apart, so a page freed, filled or read out of order holds the wrong KV."""

import pytest
import torch
from test_radix_cache import P, holds, kv_value, write

from tandem.config import PRESETS
from tandem.engine.host_tier import HostTier
from tandem.engine.kv_pool import KVPool
from tandem.engine.radix_cache import RadixCache

NUM_PAGES, HOST_PAGES = 6, 10


def _conversation(policy: str, copy: str = "staged"):
    """A tier in deferred mode (its copies `copy`) and a cache holding one computed sequence (its pages still on the
    device)."""
    pool = KVPool(PRESETS["tiny"], NUM_PAGES, P, torch.float32, "cpu")
    tier = HostTier(pool, HOST_PAGES, policy, deferred=True, copy=copy)
    cache = RadixCache(pool, tier)
    tokens = list(range(3, 3 + 3 * P))
    pages = pool.alloc(3)
    write(pool, pages, tokens, 0, len(tokens))
    cache.insert(tokens, pages)
    pool.decref(pages)
    return pool, tier, cache, tokens


def _admit_loading(pool: KVPool, cache: RadixCache, tokens: list[int]) -> list[int]:
    m = cache.match(tokens)
    assert m.loads, "the sequence should be on the host only"
    table = cache.load(m, pool.alloc(len(m.loads)))
    cache.tier.before_compute()
    return table


@pytest.mark.parametrize("mutant", [False, True])
def test_a_host_page_a_load_still_reads_is_never_freed_under_it(monkeypatch, mutant):
    """Rule 3: the load's transfer runs on its own stream, issued with the schedule's other loads, so it may read a
    host page after a backup (another stream, which may run ahead) wrote a page the tree freed meanwhile. Held, the
    page is not freed."""
    if mutant:
        monkeypatch.setattr(HostTier, "_hold", lambda self, op, pages: None)
        monkeypatch.setattr(HostTier, "_unhold", lambda self, op: None)
    pool, tier, cache, tokens = _conversation("write_through")
    tier.reap()  # the backups landed
    cache.evict(NUM_PAGES)
    m = cache.match(tokens)
    fresh = pool.alloc(len(m.loads))
    tier.load(m.host_pages, fresh)  # (its transfer not issued yet)
    cache.reset()  # the tree lets go of the host pages
    other = list(range(200, 200 + 3 * P))
    pages = pool.alloc(3)
    write(pool, pages, other, 0, len(other))
    cache.insert(other, pages)  # backed up into whatever host pages are free
    tier.flush()  # (the engine's next reap does)
    backup = tier.ops[-1]
    backup.pending, run = None, backup.pending
    run()  # the backup stream runs ahead of the tier stream
    tier.before_compute()
    assert holds(pool, fresh, tokens) != mutant


@pytest.mark.parametrize("mutant", [False, True])
def test_a_load_of_a_page_whose_backup_is_in_flight_reads_the_backups_staging(monkeypatch, mutant):
    """Rule 4 (write_back): eviction backs a page up and frees it at once; a request that wants it back before
    the backup landed takes it from the backup's staging, never from the host page not yet written."""
    if mutant:
        monkeypatch.setattr(HostTier, "_in_flight_backup", lambda self, h: None)
    pool, tier, cache, tokens = _conversation("write_back")
    assert cache.evict(NUM_PAGES) == 3 and pool.num_free == NUM_PAGES  # freed at once: the gather read them
    assert tier.ops[0].pending is not None  # the backup's transfer has not landed
    table = _admit_loading(pool, cache, tokens)
    assert holds(pool, table, tokens) != mutant
    assert tier.pages_from_backups == (0 if mutant else 3)


@pytest.mark.parametrize("mutant", [False, True])
def test_a_step_never_waits_for_a_backup(monkeypatch, mutant):
    """Backups run on their own stream: a load's scatter (what the next step waits for) does not land a backup
    issued before it. The mutant puts both on one stream in issue order, as before."""
    if mutant:
        join = HostTier.before_compute

        def one_stream(self):
            if self._unjoined:
                self.land(self._unjoined[-1].id)
            join(self)

        monkeypatch.setattr(HostTier, "before_compute", one_stream)
    pool, tier, cache, tokens = _conversation("write_through")
    tier.reap()
    cache.evict(NUM_PAGES)
    other = list(range(200, 200 + 2 * P))
    pages = pool.alloc(2)
    write(pool, pages, other, 0, len(other))
    cache.insert(other, pages)  # a backup in flight
    backup = tier.ops[-1]
    table = _admit_loading(pool, cache, tokens)
    assert holds(pool, table, tokens)
    assert (backup.pending is None) == mutant


def _host_holds(tier: HostTier, host_pages: list[int], tokens: list[int]) -> bool:
    """Whether the host pages hold the KV of `tokens`, page by page."""
    return all(tuple(tier.kv[h, i, 0, pos % P, 0, 0].item() for i in (0, 1)) == kv_value(tokens, pos)
               for pos in range(len(tokens)) for h in [host_pages[pos // P]])


def _drop_pool_holds(monkeypatch) -> None:
    monkeypatch.setattr(HostTier, "_hold_pool", lambda self, pages: None)
    monkeypatch.setattr(HostTier, "_drop_pool", lambda self, op: setattr(op, "device_pages", []))


@pytest.mark.parametrize("mutant", [False, True])
def test_a_queued_backup_keeps_its_pool_pages_until_its_gather(monkeypatch, mutant):
    """Rule 3 for the pool pages of a backup queued until the step's flush: the caller drops its references at once
    (write_back eviction frees the pages it backs up), so without the tier's hold a page could be handed out and
    rewritten before the gather reads it, and the host copy would hold the new owner's KV."""
    if mutant:
        _drop_pool_holds(monkeypatch)
    pool = KVPool(PRESETS["tiny"], NUM_PAGES, P, torch.float32, "cpu")
    tier = HostTier(pool, HOST_PAGES, "write_back", deferred=True)
    tokens = list(range(3, 3 + 2 * P))
    pages = pool.alloc(2)
    write(pool, pages, tokens, 0, len(tokens))
    host = sorted(tier.alloc(2))
    tier.backup(pages, host)
    pool.decref(pages)
    others = pool.alloc(pool.num_free)  # everything free now: with the mutant, the queued pages too
    other = list(range(100, 100 + len(others) * P))
    write(pool, others, other, 0, len(other))
    tier.reap()  # flushes: the gather reads the pages now
    assert _host_holds(tier, host, tokens) != mutant


@pytest.mark.parametrize("mutant", [False, True])
def test_a_load_keeps_its_pool_pages_until_its_scatter(monkeypatch, mutant):
    """Rule 3 for the pool pages a load fills: held from its issue to its scatter, so they cannot be handed out and
    written by someone else first (whose KV the scatter would then overwrite)."""
    if mutant:
        _drop_pool_holds(monkeypatch)
    pool, tier, cache, tokens = _conversation("write_through")
    tier.reap()
    cache.evict(NUM_PAGES)
    m = cache.match(tokens)
    fresh = pool.alloc(len(m.loads))
    tier.load(m.host_pages, fresh)
    pool.decref(fresh)  # (the caller's references go before the scatter)
    others = pool.alloc(pool.num_free)
    other = list(range(200, 200 + len(others) * P))
    write(pool, others, other, 0, len(other))
    tier.before_compute()
    assert holds(pool, others, other) != mutant
