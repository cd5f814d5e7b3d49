"""The host tier's copies by kernel launches: direct (`host_cache_copy: direct`, each copy one `move_pages` launch)
and staged_kernels (the staged halves, each one launch): the same stateful model and random scheduler workloads as
the staged tier's (under Triton's CPU interpreter here, on the
device in the `gpu` cases, with steps that stall so copies overlap compute), the traced work against the
placement, the mutants each protection exists for, and the engine's outputs unchanged."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so before the import

from test_host_tier import STALL, TierModel, agent_turns, run_model, slow_transfers  # noqa: E402
from test_host_tier_rules import _conversation  # noqa: E402
from test_radix_cache import holds  # noqa: E402
from test_scheduler import run_random_scenarios  # noqa: E402

from tandem.config import EngineConfig  # noqa: E402
from tandem.engine.host_tier import HostTier  # noqa: E402
from tandem.engine.step_order import TIER, TIER_DIRECT  # noqa: E402
from tandem.engine.streams import MUTANT_ENV, StreamRuntime, engine_placements  # noqa: E402

KERNEL_COPIES = ["staged_kernels", "direct"]


@pytest.mark.parametrize("copy", KERNEL_COPIES)
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_random_event_sequences_keep_pools_tree_and_kv_consistent(policy, copy):
    model = type("Model", (TierModel,), {"policy": policy, "copy": copy})
    assert run_model(model, max_examples=60) >= 10


@pytest.mark.parametrize("copy", KERNEL_COPIES)
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_random_workloads_load_back_and_keep_pages_and_kv_consistent(policy, copy):
    totals = run_random_scenarios(20, headroom_pages=0, host_pages=12, policy=policy, copy=copy)
    assert totals["host_tokens"] > 50 and totals["from_prefetch"] > 0
    assert (totals["from_backups"] == 0) == (copy == "direct")  # (no staging kept for a direct backup)


def test_the_direct_tier_issues_only_its_described_work():
    """Backups, loads, prefetches and the pages loads take from them: every work entered is a direct placement's
    (none of the staged halves), and each is entered."""
    order = StreamRuntime(engine_placements(), torch.device("cpu"), trace=True)
    totals, seen = None, set()
    original = HostTier.__init__

    def traced(self, *args, **kwargs):
        original(self, *args, **{**kwargs, "order": order})

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HostTier, "__init__", traced)
        totals = run_random_scenarios(10, headroom_pages=0, host_pages=12, policy="write_through", copy="direct")
    seen = set(order.trace)
    assert totals["from_prefetch"] > 0
    assert seen == {w.name for w in TIER_DIRECT}, seen ^ {w.name for w in TIER_DIRECT}
    assert not seen & ({w.name for w in TIER} - {w.name for w in TIER_DIRECT})


@pytest.mark.parametrize("copy", KERNEL_COPIES)
def test_a_load_taking_pages_from_a_prefetch_before_it_landed_is_caught(monkeypatch, copy):
    monkeypatch.setattr(HostTier, "_await_transfer", lambda self, op: None)
    with pytest.raises(AssertionError, match="wrong KV"):
        run_random_scenarios(20, headroom_pages=0, host_pages=12, policy="write_through", copy=copy)


def test_a_staged_kernels_load_reading_a_host_page_its_backup_has_not_filled_is_caught(monkeypatch):
    """Rule 4 with the staged halves as launches: the load must take the page from the backup's staging."""
    monkeypatch.setattr(HostTier, "_in_flight_backup", lambda self, h: None)
    with pytest.raises(AssertionError, match="reads KV before its load landed|wrong"):
        run_model(type("Model", (TierModel,), {"policy": "write_back", "copy": "staged_kernels"}), max_examples=300,
                  shrink=False)


@pytest.mark.parametrize("mutant", [False, True])
def test_a_load_of_a_page_whose_backup_is_in_flight_reads_the_host_page_after_it(monkeypatch, mutant):
    """Rule 4, direct (write_back): the backup is a launch on the compute stream, so a load behind it reads the host
    page it filled; no staging is kept for it. The mutant (a backup that never lands) is caught."""
    if mutant:
        monkeypatch.setattr(HostTier, "_move_out", lambda self, op, t: t)
    pool, tier, cache, tokens = _conversation("write_back", copy="direct")
    assert cache.evict(6) == 3 and pool.num_free == 6  # backed up and freed at once, the backup not reaped
    assert tier.in_flight
    m = cache.match(tokens)
    table = cache.load(m, pool.alloc(len(m.loads)))
    tier.before_compute()
    assert holds(pool, table, tokens) != mutant
    assert tier.pages_from_backups == 0


@pytest.mark.gpu
@pytest.mark.parametrize("copy", KERNEL_COPIES)
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("slow", [False, True])
def test_gpu_kernel_copies_overlapping_compute_keep_every_kv_right(monkeypatch, policy, slow, copy):
    """Steps that stall on the device, so a backup's launch runs after the host has moved on, and (`slow`)
    transfers on the side streams that land late."""
    if slow:
        slow_transfers(monkeypatch)
    totals = run_random_scenarios(40, headroom_pages=0, host_pages=12, policy=policy, copy=copy, **STALL)
    assert totals["host_tokens"] > 200 and totals["from_prefetch"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("mutant", ["direct_before_compute", "direct_take_not_joined"])
def test_gpu_direct_copies_not_ordered_with_compute_are_caught(monkeypatch, mutant):
    """Backups and loads off the compute stream waiting for no compute; pages taken from a prefetch's staging
    before its (slowed) transfer landed."""
    monkeypatch.setenv(MUTANT_ENV, mutant)
    slow_transfers(monkeypatch)
    with pytest.raises(AssertionError, match="wrong KV"):
        run_random_scenarios(40, headroom_pages=0, host_pages=12, policy="write_through", copy="direct", **STALL)


@pytest.mark.gpu
@pytest.mark.parametrize("copy", KERNEL_COPIES)
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_gpu_greedy_multi_turn_episodes_are_identical_with_kernel_copies(policy, copy):
    small = dict(page_size=4, num_pages=48, max_prefill_tokens=64, device="cuda")
    off, _ = agent_turns(EngineConfig(**small))
    on, stats = agent_turns(EngineConfig(**small, host_cache=policy, host_cache_pages=256, host_cache_copy=copy))
    assert stats.host_pages_loaded > 0
    assert [o.output_ids for o in on] == [o.output_ids for o in off]
