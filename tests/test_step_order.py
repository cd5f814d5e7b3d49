"""The step placement as data (tandem.engine.step_order): the checker accepts the engine's placements and rejects
every mutant; the engine's code issues exactly the work the placement describes; the race guard counts."""

import asyncio
import dataclasses
import itertools

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine import step_order
from tandem.engine.engine import Engine
from tandem.engine.model_runner import ModelRunner
from tandem.engine.step_order import (
    DECODE,
    EAGER,
    IN_USE,
    PREP,
    TIER,
    TIER_DIRECT,
    UPDATE,
    check,
    check_all,
    mutants,
)
from tandem.engine.streams import MUTANT_ENV, RaceGuard, StreamRuntime, engine_placements
from tandem.types import SamplingParams


def test_the_engines_placements_hold_every_property_at_small_tp_sizes():
    assert check_all(IN_USE, length=3, tp_sizes=(1, 2, 4)) == []
    assert check_all((PREP, EAGER, UPDATE), length=3, tp_sizes=(1, 2)) == []  # prep stream with both edges


@pytest.mark.parametrize("name", sorted(mutants()))
def test_every_mutant_is_rejected_for_its_property(name):
    prop, placement = mutants()[name]
    single = placement.name.split("+")[0] in {p.name for p in step_order.SINGLE_RANK}
    found = [v for seq in ([placement] * 3, [DECODE, placement, EAGER]) for v in check(seq, 1 if single else 2)]
    assert prop in {v.property for v in found}, (name, found)


def test_a_host_sync_in_preparation_is_no_hazard_without_collectives():
    _, placement = mutants()["pageable_copy"]
    assert check([placement] * 3, tp=1) == []  # one rank: a stall, bounded by the step in flight
    # nor behind the trainer's weight broadcast (a collective at any size), which the host waited for already
    assert check([UPDATE, placement, placement], tp=1) == []
    assert check([UPDATE.replaced("weights_land", kind="wait", stream="compute"), placement], tp=1)  # unless not


def test_a_collective_on_its_own_stream_joined_back_still_stalls_preparation():
    _, placement = mutants()["collective_joined"]
    messages = [v.message for v in check([placement] * 3, tp=2) if v.property == "sync_behind_collective"]
    assert any(m.startswith("step_inputs") and "agree (iteration" in m for m in messages), messages
    # without the join the copy-out does not wait for it, yet the step's replay (collectives inside) still does
    unjoined = DECODE.replaced("agree", stream="collective").replaced("step_inputs", kind="sync")
    assert not any("agree" in v.message for v in check([unjoined] * 3, tp=2) if v.property == "sync_behind_collective")


def test_ranks_issuing_collectives_in_different_orders_hang():
    swapped = DECODE.swapped("replay", "agree")
    assert [v.property for v in check([DECODE] * 2, tp=2, ranks={1: [swapped] * 2})] == ["hang"]
    assert all(v.property != "hang" for v in check([swapped] * 2, tp=2))


def test_placements_refuse_unknown_names():
    with pytest.raises(KeyError, match="not in placement"):
        DECODE["graph_replay"]
    with pytest.raises(ValueError, match="stream"):
        step_order.Work("x", "side", "copy")
    runtime = StreamRuntime(IN_USE, torch.device("cpu"))
    with pytest.raises(KeyError, match="describe it there first"), runtime.work("prefetch"):
        pass


def test_the_mutant_switch(monkeypatch):
    assert engine_placements() == IN_USE
    monkeypatch.setenv(MUTANT_ENV, "prep_without_war")
    changed = [p for p, q in zip(engine_placements(), IN_USE, strict=True) if p != q]
    assert changed and all(p["step_inputs"].stream == "prep" for p in changed)
    # (no step_inputs there)
    assert {p.name for p in IN_USE} - {p.name for p in changed} == {"eager", "eager_direct", "weights"}
    monkeypatch.setenv(MUTANT_ENV, "copies_before_compute")  # every placement that holds the work gets the mutant's
    assert [p["tier_gather"].stream for p in engine_placements()[:2]] == ["backup", "backup"]
    StreamRuntime(engine_placements(), torch.device("cpu"))
    with pytest.raises(ValueError, match="described twice"):
        StreamRuntime((DECODE, EAGER.replaced("tier_join", after=())), torch.device("cpu"))
    monkeypatch.setenv(MUTANT_ENV, "prep_without_waw")
    with pytest.raises(ValueError, match="prep_without_war"):
        engine_placements()


STEP_STARTS = ("sampling_params", "step_inputs")  # (an eager step's first work, a decode step's)


def _in_order(trace: list[str], placement) -> bool:
    """Whether one step's traced works (from its first, `STEP_STARTS`, to the next step's) appear in the placement's
    issue order. The tier's copies are left out: the host issues backups wherever requests finish or prefixes
    complete, and the checker's model places them where they wait for the least (`after` the compute so far)."""
    names = [w.name for w in placement.works if w.phase != "schedule"]
    positions = [names.index(n) for n in trace if n in names]
    return positions == sorted(positions)


def test_the_engine_issues_exactly_the_described_work_in_the_described_order():
    """Decode steps, eager prefill steps, host-tier backups and loads, a weight update: every piece of device work
    the engine issues is one the placement names, in its order, and every described work is issued."""
    config = EngineConfig(page_size=4, num_pages=24, max_prefill_tokens=64, host_cache="write_through",
                          host_cache_pages=64)
    sp = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    with Engine("tiny", config) as engine:
        engine.core.order.trace = trace = []
        prompts = [[(7 * i + j) % 500 + 2 for j in range(30 + 3 * i)] for i in range(6)]

        async def turns():
            outs = await asyncio.gather(*[engine.generate(p, sp) for p in prompts])
            nexts = [p + o.output_ids for p, o in zip(prompts, outs, strict=True)]
            return await asyncio.gather(*[engine.generate(n, sp) for n in nexts])

        asyncio.run(turns())
        named = dict(engine.model.state_dict())
        asyncio.run(engine.pause("abort"))
        asyncio.run(engine.update_weights({"model.norm.weight": named["model.norm.weight"]}))
    issued = set(trace)
    described = {w.name for p in IN_USE for w in p.works if not w.tp_only and w.stream != "transport"}
    described -= {"kv_import", "kv_export", "kv_pin"}  # (prefill/decode servers: traced in the next test)
    described -= {w.name for w in TIER_DIRECT} - {w.name for w in TIER}  # (a CPU tier's are staged; see below)
    cpu_only_absent = {"copy_out", "weights_land"}  # the copy to pinned memory is CUDA's; the land the transport's
    assert issued == described - cpu_only_absent, (issued ^ (described - cpu_only_absent))
    steps, current = [], []
    for name in trace:
        if name in STEP_STARTS and current:
            steps.append(current)
            current = []
        current.append(name)
    steps.append(current)
    for step in steps:
        assert _in_order(step, EAGER if "forward" in step else DECODE), step
    loads = [i for i, n in enumerate(trace) if n == "tier_load"]
    assert loads, "the test meant to make the tier load pages back"
    for i in loads:  # every load joined before the next compute that may read its pages
        rest = trace[i:]
        next_compute = min(rest.index(n) for n in ("replay", "forward") if n in rest)
        assert "tier_join" in rest[:next_compute], trace[i:i + 8]


def test_prefill_and_decode_servers_issue_their_kv_copies_as_described():
    """A prefill server's export and a decode server's import, in their placements' order."""
    sp = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True, seed=3)
    prompt = list(range(2, 40))

    async def go():
        with Engine("tiny", EngineConfig(page_size=4, num_pages=64, role="prefill")) as p, \
                Engine("tiny", EngineConfig(page_size=4, num_pages=64, role="decode")) as d:
            p.core.order.trace, d.core.order.trace = [], []
            pinned = await p.generate(prompt[:-4], dataclasses.replace(sp, max_new_tokens=1), export_kv_from=0,
                                      export_pinned=True)
            pinned.kv.free(taken=True)
            first = await p.generate(prompt, dataclasses.replace(sp, max_new_tokens=1), export_kv_from=0)
            out = await d.generate_imported(prompt, sp, (first.output_ids, first.output_logprobs,
                                                         first.weight_versions), first.kv)
            assert len(out.output_ids) == 4
            return p.core.order.trace, d.core.order.trace

    exported, imported = asyncio.run(go())
    assert "kv_export" in exported and "kv_import" in imported and "kv_pin" in exported
    pinning = exported[:exported.index("kv_pin") + 1]  # (pinned as its step was launched, before its result)
    assert "forward" in pinning and "read_tokens" not in pinning[pinning.index("forward"):], pinning
    starts = [i for i, name in enumerate(exported) if name in STEP_STARTS] + [len(exported)]
    for a, b in itertools.pairwise(starts):  # (step by step: the two requests' steps, each with what follows it)
        assert _in_order(exported[a:b], step_order.PREFILL_SERVER), exported[a:b]
    assert imported.index("kv_import") < imported.index("step_inputs")


def test_race_guard_counts_changes_during_a_replay():
    a, b = torch.arange(10), torch.zeros(3, 4, dtype=torch.int32)
    guard = RaceGuard([a, b])
    guard.before()
    guard.after()
    assert guard.count() == 0
    guard.before()
    a[2] += 1
    b[1, :3] = 7
    guard.after()
    assert (guard.count(), guard.replays) == (4, 2)


def test_race_guard_around_the_engines_fixed_buffer_replays(monkeypatch):
    """Normal steps read 0; a forward pass that rewrites its own inputs while it runs (what a prep stream without
    the write-after-read edge does) is counted."""
    config = EngineConfig(page_size=4, num_pages=64, race_guard=True)
    sp = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)

    def run():
        with Engine("tiny", config) as engine:
            async def four():
                await asyncio.gather(*[engine.generate([5, 6, 7, i + 2], sp) for i in range(4)])

            asyncio.run(four())
            return engine.runner.guard.count(), engine.runner.guard.replays

    changed, replays = run()
    assert changed == 0 and replays >= 7
    forward = ModelRunner._forward_decode

    def racing(self, bs, width=None):
        out = forward(self, bs, width)
        self.decode_in.views(bs)["seq_lens"].add_(1)  # the next step's inputs landing while this one runs
        return out

    monkeypatch.setattr(ModelRunner, "_forward_decode", racing)
    changed, replays = run()
    assert changed >= replays


def _guard_reading(monkeypatch, mutant: str | None) -> tuple[int, int]:
    """The race guard's count on qwen3-0.6b under `benchmarks/race_guard.py`'s workload: 64 requests, prompts of
    32-512 tokens, 128 new tokens each (prefill steps interleaved with decode steps, replays long enough for the
    host to run ahead)."""
    if mutant:
        monkeypatch.setenv(MUTANT_ENV, mutant)
    config = EngineConfig(device="cuda", num_pages=8192, max_running_requests=64, race_guard=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 150_000, (int(n),), generator=gen).tolist()
               for n in torch.randint(32, 513, (64,), generator=gen)]
    with Engine("qwen3-0.6b", config, dtype="bfloat16") as engine:
        async def batch():
            await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=128, ignore_eos=True, seed=i))
                                   for i, p in enumerate(prompts)])

        asyncio.run(batch())
        return engine.runner.guard.count(), engine.runner.guard.replays


@pytest.mark.gpu
def test_gpu_race_guard_reads_zero_on_the_placement_and_fires_on_the_broken_one(monkeypatch):
    changed, replays = _guard_reading(monkeypatch, None)
    assert changed == 0 and replays > 128
    changed, replays = _guard_reading(monkeypatch, "prep_without_war")
    assert changed > 0, replays


@pytest.mark.gpu
def test_gpu_the_engine_issues_the_described_work_on_cuda():
    with Engine("tiny", EngineConfig(device="cuda", page_size=4, num_pages=64)) as engine:
        engine.core.order.trace = trace = []
        asyncio.run(engine.generate([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=4)))
    assert {"input_ids", "step_inputs", "replay", "sample", "copy_out", "read_tokens"} <= set(trace)
    first = trace.index("step_inputs")
    step = trace[first:trace.index("step_inputs", first + 1)] if trace.count("step_inputs") > 1 else trace
    assert _in_order(step, DECODE), trace
