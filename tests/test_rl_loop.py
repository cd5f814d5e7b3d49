"""The fully-async RL loop end to end on CPU: learning, accounting under weight updates, checkpoints."""


import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.config import RolloutConfig, RunConfig
from tandem.rollout import manager as manager_module
from tandem.run.loop import run_recording as record


def run_recording(overrides: list[str]):
    return record(RunConfig.load(None, overrides))


def quarter_means(history):
    r = [h["reward_mean"] for h in history]
    n = max(1, len(r) // 4)
    return sum(r[:n]) / n, sum(r[-n:]) / n


@pytest.mark.parametrize("staleness", [0, 2])
def test_target_tokens_reward_rises(tmp_path, staleness):
    _, history, _ = run_recording(["task=target_tokens", "steps=40", "trainer.lr=1e-2", "rollout.group_size=8",
                                   f"rollout.max_staleness={staleness}", f"out_dir={tmp_path}"])
    first, last = quarter_means(history)
    assert first < 0.25 and last > first + 0.3, (first, last)


@pytest.mark.parametrize("staleness", [0, 2])
def test_guess_number_reward_rises(tmp_path, staleness):
    _, history, _ = run_recording(["task=guess_number", "steps=60", "trainer.lr=1e-2", "rollout.group_size=8",
                                   f"rollout.max_staleness={staleness}", f"out_dir={tmp_path}"])
    r = [h["reward_mean"] for h in history]
    n = len(r) // 4
    first, best = sum(r[:n]) / n, max(sum(r[i:i + n]) / n for i in range(len(r) - n + 1))
    # the best quarter-long stretch, not the last quarter: at this lr a learning run may collapse for a while (its
    # policy moves so fast that samples two versions old are far off it) and recover only after the run's end. The
    # rise asked for sits between the least that learning runs rise and what runs that cannot learn (lr near 0) do
    assert first < 0.1 and best > first + 0.1, (first, best)


def check_accounting(run, trained, max_staleness):
    manager = run.manager
    trained_ids = [g.index for _, groups in trained for g in groups]
    assert len(trained_ids) == len(set(trained_ids)), "a group was trained twice"
    accounted = set(trained_ids) | set(manager.buffer) | set(manager.in_flight) | manager._dropped_indices
    assert accounted == set(range(manager.next_index)), "an admitted group is unaccounted for"
    for version, groups in trained:
        for g in groups:
            if run.cfg.rollout.batch_order == "admission":
                assert g.index // run.cfg.rollout.batch_groups == version, "trained outside its batch window"
            assert version - g.start_version <= max_staleness, "trained after its deadline"
            for e in g.episodes:
                versions = [v for v, m in zip(e.versions, e.loss_mask, strict=True) if m]
                assert versions == sorted(versions), "versions not monotone within an episode"
                assert all(0 <= version - v <= max_staleness for v in versions), (version, versions)
                assert min(versions) >= e.start_version


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(staleness=st.integers(0, 3), mode=st.sampled_from(["abort", "retract", "in_place"]),
       order=st.sampled_from(["deadline", "admission"]), group_size=st.integers(2, 3), batch_groups=st.integers(1, 3),
       slots=st.integers(3, 12), latency=st.sampled_from([0.0, 0.002]), seed=st.integers(0, 1000))
def test_accounting_and_staleness_under_weight_updates(tmp_path_factory, staleness, mode, order, group_size,
                                                        batch_groups, slots, latency, seed):
    out = tmp_path_factory.mktemp("run")
    run, history, trained = run_recording([
        "steps=4", f"seed={seed}", f"out_dir={out}", f"rollout.max_staleness={staleness}",
        f"rollout.pause_mode=\"{mode}\"", f"rollout.batch_order=\"{order}\"", f"rollout.group_size={group_size}",
        f"rollout.batch_groups={batch_groups}",
        f"rollout.num_in_flight={max(slots, group_size)}", f"random_agent.tool_latency_s={latency}",
        "random_agent.prompt_len_max=40", "random_agent.response_len_median=6", "random_agent.response_len_max=64",
        "random_agent.max_context=256"])
    check_accounting(run, trained, staleness)
    assert all(h["staleness_max"] <= staleness for h in history)
    slots = run.cfg.rollout.num_in_flight
    assert all(0 < h["episode_seconds"] <= slots * h["wall_s"] for h in history[1:])
    # the distribution: trained tokens per staleness, every one counted once
    assert all(len(h["staleness_tokens"]) <= staleness + 1 and sum(h["staleness_tokens"]) == h["tokens_trained"]
               for h in history)


def test_abort_mode_resubmits_partial_turns_and_stitches_them(tmp_path):
    run, _, trained = run_recording([f"out_dir={tmp_path}", "steps=4", "rollout.pause_mode=\"abort\"",
                                     "random_agent.response_len_median=40", "random_agent.response_len_sigma=0.1"])
    check_accounting(run, trained, 2)
    episodes = [e for _, gs in trained for g in gs for e in g.episodes]
    stitched = [e for e in episodes if e.num_resubmits]
    assert stitched, "no turn was cut by a pause: the test did not exercise stitching"
    assert any(len({v for v in e.versions if v >= 0}) > 1 for e in stitched)


@pytest.mark.parametrize("order", ["deadline", "admission"])
def test_checkpoint_resume_loses_nothing_and_keeps_the_bound(tmp_path, order):
    common = [f"out_dir={tmp_path}", "rollout.max_staleness=2", "rollout.batch_groups=2", "rollout.group_size=2",
              "random_agent.tool_latency_s=0.002", "random_agent.response_len_median=6",
              f"rollout.batch_order=\"{order}\""]
    first, _, trained_a = run_recording(["steps=3", *common])
    state = first.manager.state_dict()
    assert state["rerun"] or state["buffer"], "the checkpoint should catch work in progress"
    second, history, trained_b = run_recording(["steps=6", "resume=true", *common])
    assert second.trainer.version == 6 and history[0]["step"] == 4
    ids_a = [g.index for _, gs in trained_a for g in gs]
    ids_b = [g.index for _, gs in trained_b for g in gs]
    assert not set(ids_a) & set(ids_b), "a group was trained before and after the resume"
    assert len(ids_a + ids_b) == 12  # batches 0..5 of 2 groups
    if order == "admission":
        assert sorted(ids_a + ids_b) == list(range(12))
    check_accounting(second, trained_a + trained_b, 2)  # every group admitted is trained, buffered or running
    for version, groups in trained_b:
        for g in groups:
            for e in g.episodes:
                assert all(version - v <= 2 for v, m in zip(e.versions, e.loss_mask, strict=True) if m)


def test_time_the_staleness_bound_held_admission_is_integrated(monkeypatch):
    """The manager's bound-seconds: time in which a group's slots were free but the staleness bound admitted no
    group; not while the slots are full (the slots, not the bound, hold admission then)."""
    now = [10.0]
    monkeypatch.setattr(manager_module.time, "perf_counter", lambda: now[0])
    cfg = RolloutConfig(group_size=2, batch_groups=1, max_staleness=0, num_in_flight=4)
    m = manager_module.RolloutManager(None, None, cfg, 64, 0, lambda: 0)
    m.next_index = m.admission_limit  # every group version 0 allows is admitted
    m.fill()  # room for a group and none allowed: held from 10
    now[0] = 12.0
    m.num_in_flight_episodes = 4  # the slots full from 12
    m.fill()
    now[0] = 15.0
    assert m.summary()["bound_seconds"] == 2.0
    m.num_in_flight_episodes = 0
    m.fill()  # held again from 15
    now[0] = 16.5
    assert m.summary()["bound_seconds"] == 3.5


def test_episodes_in_flight_are_integrated_over_time(monkeypatch):
    """The manager's episode-seconds: two episodes for 1 s, then one for 2 s, make 4 (each change first adds the
    time at the old count)."""
    now = [10.0]
    monkeypatch.setattr(manager_module.time, "perf_counter", lambda: now[0])
    m = manager_module.RolloutManager(None, None, RolloutConfig(group_size=2), 64, 0, lambda: 0)
    m._count(2)
    now[0] = 11.0
    m._count(-1)
    now[0] = 13.0
    assert m.summary()["episode_seconds"] == 4.0 and m.summary()["in_flight_episodes"] == 1
