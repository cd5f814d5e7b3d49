"""The pause / load weights / continue protocol's model (`tandem.verify.pause_model`): exhaustively correct for small
sizes, each protection proven by a mutant that the checker catches, and the real engine's command sequence a trace
the model accepts."""

import asyncio
import contextlib

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine import commands
from tandem.engine.core import EngineCore, EngineError
from tandem.engine.engine import Engine
from tandem.types import PAUSED_ABORT, SamplingParams
from tandem.verify.pause_model import (
    DONE,
    MUTANTS,
    NEW,
    RUNNING,
    WAITING,
    PauseModel,
    command_name,
    explore,
    replay,
)


@pytest.mark.parametrize("sizes", [
    dict(num_requests=2, num_followers=1, max_tokens=2, num_versions=2, cancels=False),
    dict(num_requests=1, num_followers=2, max_tokens=2, num_versions=2, cancels=False),
    dict(num_requests=1, num_followers=1, max_tokens=3, num_versions=2, cancels=True),
], ids=lambda sizes: "-".join(f"{k}={v}" for k, v in sizes.items()))
def test_every_reachable_state_of_the_protocol_keeps_every_property(sizes):
    result = explore(PauseModel(**sizes))
    assert result.counterexample is None, str(result.counterexample)
    assert result.num_states > 1000  # it explored more than the happy path


MUTANT_SIZES = dict(num_requests=2, num_followers=1, max_tokens=2, num_versions=1, cancels=False)


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_removing_a_protection_is_caught_with_a_trace_naming_its_property(mutant):
    model = PauseModel(**MUTANT_SIZES, mutant=mutant)
    cex = explore(model).counterexample
    assert cex is not None, f"mutant {mutant} not caught"
    assert cex.prop == MUTANTS[mutant], str(cex)
    state, replayed = replay(model, list(cex.trace))  # the trace is a run of the model that ends in the violation
    if cex.prop == "deadlock":
        assert replayed is None and not model.is_end(state)
    else:
        assert replayed is not None and replayed.prop == cex.prop and replayed.trace == cex.trace


def test_a_load_kept_off_the_followers_fails_at_the_follower_s_next_step():
    cex = explore(PauseModel(**MUTANT_SIZES, mutant="load_not_published")).counterexample
    assert any(a.startswith("rank 0 applies load v1") for a in cex.trace), str(cex)
    assert cex.trace[-1] == "follower 1 applies step v1", str(cex)


def test_a_trace_with_an_action_the_model_does_not_enable_is_refused():
    model = PauseModel(num_requests=1, num_versions=1)
    _, cex = replay(model, ["client adds r0", "rank 0 takes a step"])  # the add is still queued
    assert cex is not None and cex.prop == "not_an_action" and cex.trace[-1] == "rank 0 takes a step"


def test_the_model_rejects_an_unknown_mutant():
    with pytest.raises(ValueError, match="mutant"):
        PauseModel(mutant="nope")


# ---- the real engine against the model -------------------------------------------------------------------------
MAX_TOKENS = 16  # enough to outlast the trainer's commands, most of the time (either way the trace must pass)
CONFIG = EngineConfig(page_size=16)


def _perturbed(model, seed):
    gen = torch.Generator().manual_seed(seed)
    return {name: p.detach() + 0.05 * torch.randn(p.shape, generator=gen) for name, p in model.named_parameters()}


def _labels(cmd: commands.Command, version: int, accepted: bool) -> list[str]:
    """The model's actions for one command the core applied (`version`: the core's before it)."""
    match cmd:
        case commands.AddRequest(rid=rid):
            return [f"client adds {rid}", f"rank 0 applies add {rid}"]
        case commands.Abort(rid=rid):
            return [f"client cancels {rid}", f"rank 0 applies abort {rid}"]
        case commands.Step():
            return ["rank 0 takes a step", f"rank 0 launches a step at v{version}",
                    f"follower 1 applies step v{version}"]
        case commands.Pause(mode=mode):
            name = command_name(("pause", mode))
        case commands.Resume():
            name = "resume"
        case commands.LoadWeights(version=v, pause_mode=mode):
            name = command_name(("load", v, mode))
            published = [f"follower 1 applies load v{v}"] if accepted else []
            return [f"trainer sends {name}", f"rank 0 applies {name}", *published]
        case _:  # Idle
            return []
    return [f"trainer sends {name}", f"rank 0 applies {name}"]


def _record(engine: Engine) -> list[tuple[commands.Command, int, bool, list]]:
    """Log each command the core applies: (command, the core's version before it, accepted, the outputs it ended)."""
    log = []
    real_apply, real_take = engine.core.apply, engine.core.take_finished

    def apply(cmd):
        version, accepted = engine.core.weight_version, False
        try:
            result = real_apply(cmd)
            accepted = True
            return result
        finally:
            log.append((cmd, version, accepted, []))

    def take_finished():
        outs = real_take()
        log[-1][3].extend(outs)
        return outs

    engine.core.apply, engine.core.take_finished = apply, take_finished
    return log


async def _client(engine: Engine, i: int):
    """The rollout manager's side of one turn: a turn cut by an abort-mode pause is resubmitted with its output."""
    prompt, outs = [2 + i, 3 + i, 4 + i], []
    while True:
        done = [t for o in outs for t in o.output_ids]
        sampling = SamplingParams(temperature=1.0, seed=i, max_new_tokens=MAX_TOKENS - len(done), ignore_eos=True)
        outs.append(await engine.generate(prompt + done, sampling, rid=f"r{i}"))
        if outs[-1].finish_reason.message != PAUSED_ABORT or len(done) + len(outs[-1].output_ids) >= MAX_TOKENS:
            return outs


async def _wait_tokens(engine: Engine, clients: list[asyncio.Task], n: int) -> None:
    """Until `n` more tokens were generated or every client is done (a poll of the engine's counter, no command)."""
    target = engine.core.stats.generated_tokens + n
    while engine.core.stats.generated_tokens < target and not all(c.done() for c in clients):
        await asyncio.sleep(0.001)


def _check_against_model(log: list, num_requests: int, num_versions: int) -> None:
    """Replay the recorded commands as model actions: each enabled, keeping every property; after each command the
    requests the model ended are those the engine returned, their tokens tagged as the engine tagged them."""
    model = PauseModel(num_requests=num_requests, num_followers=1, max_tokens=MAX_TOKENS, num_versions=num_versions,
                       num_pages=3 * num_requests)
    s, returned, num_actions = model.initial(), [0] * num_requests, 0
    for cmd, version, accepted, finished in log:
        before, labels = s, _labels(cmd, version, accepted)
        s, cex = replay(model, labels, start=before)
        assert cex is None, f"after {num_actions} actions: {cex}"
        num_actions += len(labels)
        left = {f"r{i}" for i, (a, b) in enumerate(zip(before.reqs, s.reqs, strict=True))
                if a.status in (WAITING, RUNNING) and b.status in (NEW, DONE)}
        assert left == {out.rid for out in finished}, (cmd, labels)
        for out in finished:
            i = int(out.rid[1:])
            tags = [tag for tag, _ in s.reqs[i].tokens[returned[i]:]]
            assert tags == out.weight_versions, f"{out.rid}: the model's tags {tags}, engine's {out.weight_versions}"
            returned[i] += len(out.output_ids)
    assert model.is_end(s), s


def test_the_engine_s_commands_under_pauses_and_updates_are_a_trace_the_model_accepts():
    """A real engine (CPU) generates for three clients while weights are updated through every pause mode, in
    both forms (one LoadWeights with a mode; pause, load, resume), and a stale duplicate is refused. Each command
    the core applies, with its finished outputs, is mapped to the model's actions (`_check_against_model`). A second
    core (the follower) applies the same commands and holds rank 0's version at every step, ending with the same
    outputs."""
    engine = Engine("tiny", CONFIG)
    weights = {v: _perturbed(engine.model, v) for v in range(1, 6)}
    log = _record(engine)

    async def go():
        clients = [asyncio.create_task(_client(engine, i)) for i in range(2)]
        await _wait_tokens(engine, clients, 3)
        await engine.load_paused(weights[1].items(), 1, "in_place")  # the step in flight keeps version 0
        await _wait_tokens(engine, clients, 2)
        await engine.pause("retract")
        cancelled = asyncio.create_task(engine.generate([9, 9, 9], SamplingParams(max_new_tokens=4), rid="r2"))
        await asyncio.sleep(0.01)  # queued while paused
        cancelled.cancel()  # the client goes away: Abort
        await asyncio.gather(cancelled, return_exceptions=True)
        assert await engine.update_weights(weights[2].items(), 2) == 2
        await engine.resume()
        await _wait_tokens(engine, clients, 2)
        await engine.load_paused(weights[3].items(), 3, "abort")  # cut turns are resubmitted
        with pytest.raises(ValueError, match="older"):
            await engine.load_paused(weights[1].items(), 2, "retract")  # a stale duplicate push
        await _wait_tokens(engine, clients, 1)
        await engine.pause("in_place")
        await engine.load_paused(weights[4].items(), 4, "retract")  # already paused: loads and stays paused
        await engine.resume()
        await engine.load_paused(weights[5].items(), 5, "retract")
        return [await c for c in clients]

    try:
        outputs = asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        engine.shutdown()
    _check_against_model(log, num_requests=3, num_versions=5)
    versions = [v for outs in outputs for o in outs for v in o.weight_versions]
    assert len(versions) == 2 * MAX_TOKENS and 0 in versions and len(set(versions)) >= 3

    follower = EngineCore("tiny", CONFIG)  # run_follower's loop, without the control channel
    for cmd, version, _, _ in log:
        if isinstance(cmd, commands.Step):
            assert follower.weight_version == version
        with contextlib.suppress(ValueError, EngineError):  # refused on rank 0 too
            follower.apply(cmd)
    follower_outs = {}
    for out in follower.take_finished():
        follower_outs.setdefault(out.rid, []).append((out.output_ids, out.weight_versions))
    for i, outs in enumerate(outputs):
        assert follower_outs[f"r{i}"] == [(o.output_ids, o.weight_versions) for o in outs]


def test_an_engine_that_tags_tokens_when_applied_fails_the_model_check():
    """The falsifier of the check above: an engine that tags each token with the version current when it is
    applied (not the one it was launched under) mislabels the step in flight across an in-place load."""
    engine = Engine("tiny", CONFIG)
    weights = _perturbed(engine.model, 1)
    resolve = engine.core.scheduler.resolve
    engine.core.scheduler.resolve = lambda req, index, token, logprob, version, top=None: resolve(
        req, index, token, logprob, engine.core.weight_version, top)
    log = _record(engine)

    async def go():
        clients = [asyncio.create_task(_client(engine, i)) for i in range(2)]
        await _wait_tokens(engine, clients, 3)
        await engine.load_paused(weights.items(), 1, "in_place")
        return [await c for c in clients]

    try:
        asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        engine.shutdown()
    with pytest.raises(AssertionError, match="the model's tags"):
        _check_against_model(log, num_requests=2, num_versions=1)
