"""A push that returns once the load is queued (`Placement.send`, `tandem.run.pending`), colocated on the CPU: the
trainer does not wait for the engine's step; its next write waits for the engine's read (`fence`); versions count
only once applied; requests submitted after the push see the new weights; pushes apply in order; a failed load
surfaces; a load queued at shutdown reads nothing. The trainer calls its hook before every write of the weights
it hands out. On a GPU: the same with the engine on its own stream (the ordering then on the device)."""

import asyncio
import concurrent.futures
import contextlib
import threading
import time

import pytest
import torch

from tandem.config import LossConfig, RunConfig, TrainerConfig
from tandem.engine.core import EngineCore
from tandem.model.loader import build_model
from tandem.run.loop import run_recording
from tandem.run.placement import place
from tandem.trainer.trainer import Trainer
from tandem.transport.weights import TransportError
from tandem.types import Episode, Group, SamplingParams

SLOW_S = 0.4  # how long the engine's thread takes to reach a load here (a step in flight, at worst a prefill)


def slow_loads(monkeypatch, seconds: float = SLOW_S) -> None:
    """Every weight load starts `seconds` late, holding the engine's thread (as a long step would)."""
    load = EngineCore._load_weights

    def slow(self, cmd):
        time.sleep(seconds)
        return load(self, cmd)

    monkeypatch.setattr(EngineCore, "_load_weights", slow)


def engine_weights(placement) -> list[torch.Tensor]:
    return [p.detach().clone() for p in placement.engine.model.parameters()]


def colocated(*overrides):
    return place(RunConfig.load(None, ["weight_sync_timeout_s=10", *overrides]))


def in_thread(fn):
    """`fn` run in another thread (the trainer's step runs in one), its result or error."""
    out = concurrent.futures.Future()

    def run():
        try:
            out.set_result(fn())
        except BaseException as e:
            out.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return out


@pytest.mark.parametrize("fenced", [True, False])
def test_send_returns_at_once_and_the_fence_keeps_the_trainers_next_write_out_of_the_load(monkeypatch, fenced):
    """The trainer's write right after the push, in its step's thread: fenced, the engine loads exactly what was
    pushed; unfenced (the control: the hazard is real), the write reaches the engine's load."""
    placement = colocated()
    trainer = build_model("tiny", seed=2)
    pushed = [p.detach().clone() for p in trainer.parameters()]

    async def go():
        await placement.start(build_model("tiny", seed=1).named_parameters(), 1)
        slow_loads(monkeypatch)
        t0 = time.perf_counter()
        pending = await placement.send(trainer.named_parameters(), 2)
        sent_s = time.perf_counter() - t0
        version_after_send = placement.engine.weight_version

        def write():  # the trainer's next step: fence, then change its weights
            if fenced:
                pending.fence()
            with torch.no_grad():
                torch._foreach_add_(list(trainer.parameters()), 1.0)

        await asyncio.wrap_future(in_thread(write))
        stats = await pending.applied()
        return sent_s, version_after_send, stats

    try:
        sent_s, version_after_send, stats = asyncio.run(go())
        loaded = engine_weights(placement)
    finally:
        placement.shutdown()
    assert sent_s < SLOW_S / 2 and version_after_send == 1  # not waited for; not in force yet
    assert stats.reply.weight_version == 2 and stats.sync_s == stats.transfer_s < stats.applied_s
    same = all(torch.equal(a, b) for a, b in zip(loaded, pushed, strict=True))
    assert same if fenced else not same


def test_requests_after_the_push_sample_with_its_weights_and_the_version_counts_once_applied(monkeypatch):
    """The load is queued ahead of every later request: a request submitted right after `send` (while the engine
    has not reached the load) samples every token with the new version; the engine's version, which the rollout
    manager reads, changes only when the load ran."""
    placement = colocated()
    model = build_model("tiny", seed=1)

    async def go():
        await placement.start(model.named_parameters(), 1)
        slow_loads(monkeypatch)
        pending = await placement.send(model.named_parameters(), 2)
        seen = placement.engine.weight_version
        out = await placement.engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
        await pending.applied()
        pending.fence()
        return seen, out

    try:
        seen, out = asyncio.run(go())
    finally:
        placement.shutdown()
    assert seen == 1 and out.weight_versions == [2] * 4


def test_two_pushes_apply_in_order_and_a_push_while_paused_loads_and_stays_paused(monkeypatch):
    placement = colocated("rollout.pause_mode=\"retract\"")
    models = {v: build_model("tiny", seed=v) for v in (1, 2, 3, 4)}

    async def go():
        await placement.start(models[1].named_parameters(), 1)
        slow_loads(monkeypatch, 0.2)
        first = await placement.send(models[2].named_parameters(), 2)
        t0 = time.perf_counter()
        second = await placement.send(models[3].named_parameters(), 3)  # waits for the first's load
        waited = time.perf_counter() - t0
        assert first.done()
        await second.applied()
        second.fence()
        at3 = engine_weights(placement)
        await placement.engine.pause("in_place")
        paused = await placement.send(models[4].named_parameters(), 4)
        await paused.applied()
        paused.fence()
        state = placement.engine.paused, placement.engine.weight_version
        await placement.engine.resume()
        return waited, at3, state

    try:
        waited, at3, state = asyncio.run(go())
        at4 = engine_weights(placement)
    finally:
        placement.shutdown()
    assert waited > 0.1
    assert all(torch.equal(a, b.detach()) for a, b in zip(at3, models[3].parameters(), strict=True))
    assert state == ("in_place", 4)
    assert all(torch.equal(a, b.detach()) for a, b in zip(at4, models[4].parameters(), strict=True))


def test_a_failed_load_surfaces_at_the_fence_and_the_next_push_and_the_engine_keeps_its_weights():
    """A tensor of the wrong shape passes the push (names and types are all it checks) and fails the engine's
    load: the trainer's fence raises it, so does the next push (once), and the push after loads."""
    placement = colocated()
    model = build_model("tiny", seed=1)
    bad = [(n, p[:1] if n == "model.norm.weight" else p) for n, p in build_model("tiny", seed=2).named_parameters()]

    async def go():
        await placement.start(model.named_parameters(), 1)
        before = engine_weights(placement)
        pending = await placement.send(bad, 2)
        with pytest.raises(ValueError, match="model.norm.weight"):
            await asyncio.wrap_future(in_thread(pending.fence))
        kept = engine_weights(placement)
        with pytest.raises(ValueError, match="model.norm.weight"):
            await placement.send(model.named_parameters(), 3)
        again = await placement.push(model.named_parameters(), 3)
        return before, kept, again.reply.weight_version

    try:
        before, kept, version = asyncio.run(go())
    finally:
        placement.shutdown()
    assert all(torch.equal(a, b) for a, b in zip(before, kept, strict=True)) and version == 3


def test_a_load_queued_at_shutdown_reads_nothing_and_its_fence_raises(monkeypatch):
    placement = colocated()
    model = build_model("tiny", seed=1)

    async def go():
        await placement.start(model.named_parameters(), 1)
        slow_loads(monkeypatch, 0.5)
        busy = placement.engine.load_soon(dict(model.named_parameters()), 2, "retract")  # holds the engine's thread
        pending = await placement.send(build_model("tiny", seed=3).named_parameters(), 3)  # queued behind it
        return busy, pending

    busy, pending = asyncio.run(go())
    placement.shutdown()
    assert busy.result(1)[0] == 2
    assert placement.engine.weight_version == 2
    with pytest.raises(TransportError, match="did not load weights version 3"):
        pending.fence()


def test_shared_send_returns_before_the_load_and_the_fenced_write_never_reaches_it():
    """The engine in its own process, the weights by reference (shared memory here, CUDA IPC on a GPU): the push
    returns once posted; the trainer's write right after its fence leaves the engine with exactly what was pushed
    (it generates as a fresh engine on those weights does); the engine's version is the reply's."""
    from tandem.engine.engine import Engine

    placement = place(RunConfig.load(None, ["placement=separate", "weight_transport=ipc", "weight_sync_timeout_s=30"]))
    trainer = build_model("tiny", seed=2)
    pushed = build_model("tiny", seed=2)
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    prompts = [[3 + i, 17, 9] for i in range(3)]

    async def go():
        await placement.start(build_model("tiny", seed=1).named_parameters(), 1)
        pending = await placement.send(trainer.named_parameters(), 2)

        def write():
            pending.fence()
            with torch.no_grad():
                torch._foreach_add_(list(trainer.parameters()), 1.0)

        await asyncio.wrap_future(in_thread(write))
        stats = await pending.applied()
        outs = [await placement.engine.generate(p, greedy) for p in prompts]
        await placement.disconnect()
        return stats, outs

    try:
        stats, outs = asyncio.run(go())
        version = placement.engine.weight_version
    finally:
        placement.shutdown()
    assert stats.reply.weight_version == version == 2 and stats.sync_s < stats.applied_s
    with Engine(pushed) as fresh:
        for p, out in zip(prompts, outs, strict=True):
            ref = asyncio.run(fresh.generate(p, greedy))
            assert ref.output_ids == out.output_ids and out.weight_versions == [2] * 8
            assert torch.allclose(torch.tensor(ref.output_logprobs), torch.tensor(out.output_logprobs), atol=1e-4)


def test_a_fence_whose_closing_fails_raises_now_and_at_every_later_fence_and_abandon_never_raises():
    """(A missing acknowledgement, say.) Without the error kept, a second fence would return as if ordered."""
    from tandem.run.pending import PendingSync
    from tandem.transport.weights import TransferStats

    def failing(ordered):
        raise TransportError("no acknowledgement")

    applied = concurrent.futures.Future()
    applied.set_result(None)
    fenced = PendingSync(1, TransferStats(1, 0, 1, 0, 0.0), applied, failing, 1.0)
    for _ in range(2):
        with pytest.raises(TransportError, match="no acknowledgement"):
            fenced.fence()
    abandoned = PendingSync(1, TransferStats(1, 0, 1, 0, 0.0), applied, failing, 1.0)
    abandoned.abandon()
    with pytest.raises(TransportError, match="no acknowledgement"):
        abandoned.fence()


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_the_trainer_calls_its_hook_before_it_writes_the_weights_it_hands_out(param_dtype):
    """With the weights the engine reads unchanged at the hook (the optimizer writes them when they are the
    masters; the refresh of the compute copy does otherwise), once per step."""
    trainer = Trainer(build_model("tiny", dtype="float32", seed=1), TrainerConfig(param_dtype=param_dtype),
                      LossConfig())
    seen = []
    before = [t.clone() for _, t in trainer.named_weights()]
    trainer.before_weight_write = lambda: seen.append([t.clone() for _, t in trainer.named_weights()])
    episodes = [Episode(f"e{i}", 0, tokens=[3, 4, 5, 6], loss_mask=[0, 1, 1, 1], behav_logprobs=[0.0, -1, -1, -1],
                        versions=[-1, 0, 0, 0], reward=float(i)) for i in range(2)]
    trainer.step([Group(0, episodes, 0)])
    assert len(seen) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, seen[0], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(before, [t for _, t in trainer.named_weights()], strict=True))


def test_a_run_fences_every_step_and_keeps_staleness_exact_with_slow_loads(tmp_path, monkeypatch):
    """Synchronous RL (max_staleness 0) with loads that reach the engine late: every trained token is of the
    batch's version (the manager counts a version only once applied), and each step's write was fenced."""
    slow_loads(monkeypatch, 0.05)
    fences = []
    from tandem.run import pending as pending_module

    fence = pending_module.PendingSync.fence
    monkeypatch.setattr(pending_module.PendingSync, "fence", lambda self: (
        fences.append((self.version, threading.current_thread() is threading.main_thread())), fence(self)))
    cfg = RunConfig.load(None, ["steps=3", f"out_dir={tmp_path}", "rollout.max_staleness=0", "rollout.group_size=2",
                                "rollout.batch_groups=2", "random_agent.response_len_median=6"])
    run, history, trained = run_recording(cfg)
    assert [h["step"] for h in history] == [1, 2, 3]
    assert all(h["staleness_max"] == 0 and h["applied_s"] >= h["sync_s"] for h in history)
    for version, groups in trained:
        for g in groups:
            for e in g.episodes:
                assert all(v == version for v, m in zip(e.versions, e.loss_mask, strict=True) if m)
    # the steps after the pushes of versions 1 and 2 fenced them (in the step's thread) before writing
    assert {v for v, main in fences if not main} == {1, 2}


@pytest.mark.gpu
def test_colocated_send_on_the_gpu_the_trainers_write_at_once_never_reaches_the_engines_copy():
    """The engine on its own stream, a push that returns before the load ran, the trainer's next write (on its
    own stream, after the fence, from its step's thread) issued at once: the engine generates exactly what a
    fresh engine on the pushed weights generates."""
    from test_placement import assert_pushed_versions_generate_as_fresh_engines, generate_greedy

    placement = place(RunConfig.load(None, ["placement=colocated", "engine.device=cuda:0", "engine.num_pages=512",
                                            "weight_sync_timeout_s=30"]))
    engine_stream = placement.engine.core.order.stream("compute")

    async def pushed():
        outputs = []
        await placement.start(build_model("tiny", seed=9).to("cuda").named_parameters(), 0)
        for version in (1, 2):
            trainer = build_model("tiny", seed=version).to("cuda")
            with torch.cuda.stream(engine_stream):
                torch.cuda._sleep(200_000_000)  # the engine's stream busy: its copy runs late on the device
            pending = await placement.send(trainer.named_parameters(), version)

            def write(pending=pending, trainer=trainer):  # the trainer's next write at once: after the engine's copy
                pending.fence()
                with torch.no_grad():
                    torch._foreach_add_(list(trainer.parameters()), 0.5)

            await asyncio.wrap_future(in_thread(write))
            await pending.applied()
            outputs.append(await generate_greedy(placement.engine))
        return outputs

    assert_pushed_versions_generate_as_fresh_engines(placement, pushed)


def test_a_cancel_that_comes_as_the_engine_applies_the_load_still_cancels_the_wait():
    """Ctrl-C cancels the run's task once: a wait for the engine's load that took the reply instead (as
    `asyncio.wait_for` does on Python 3.11 when both come in one turn of the loop) left the run training on. Every
    turn the cancel may come in, from the reply's to the waiter's, must end the wait cancelled."""
    from cancel_helpers import cancel_outcomes

    from tandem.run.pending import PendingSync
    from tandem.transport.weights import TransferStats

    def make():
        reply = concurrent.futures.Future()
        pending = PendingSync(1, TransferStats(1, 0, 1, 0, 0.0), reply, lambda ordered: None, 10.0)
        return pending.applied(), lambda: reply.set_result(object())

    outcomes = cancel_outcomes(make, 8)
    assert False not in outcomes, f"a cancel taken by the wait was swallowed ({outcomes}: turns after the reply)"
    assert outcomes[0] and outcomes[-1] is None  # (the sweep spans the reply's way, from before to after)


def test_a_run_whose_cancel_an_await_swallowed_stops_at_its_next_step(tmp_path):
    """The run's loop checks, each step, for a cancel that some await took without raising (Ctrl-C cancels the
    task once): it stops there, its checkpoint saved (falsifier: without the check the run trains on to the end)."""
    from tandem.run.loop import CHECKPOINT, Run

    cfg = RunConfig.load(None, ["steps=40", f"out_dir={tmp_path}", "rollout.group_size=2", "rollout.batch_groups=2",
                                "random_agent.response_len_median=4", "random_agent.response_len_max=8"])
    run = Run(cfg)
    send, sending = run.placement.send, asyncio.Event()

    async def swallowing_send(*args):
        if run.trainer.version >= 2:
            sending.set()
            with contextlib.suppress(asyncio.CancelledError):  # (the await that takes the cancel and goes on)
                await asyncio.sleep(0.5)
        return await send(*args)

    run.placement.send = swallowing_send

    async def go():
        training = asyncio.ensure_future(run.train())
        await sending.wait()
        training.cancel()
        with pytest.raises(asyncio.CancelledError):
            await training

    try:
        asyncio.run(go())
    finally:
        run.shutdown()
    assert run.trainer.version <= 3 and (tmp_path / CHECKPOINT).is_file()
