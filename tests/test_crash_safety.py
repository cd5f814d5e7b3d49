"""Runs survive being stopped at any moment: SIGTERM saves like Ctrl-C and exits non-zero, a SIGKILLed run resumes
from its last checkpoint with one metrics record per step, a resume needs a checkpoint, checkpoints load without
running code, and groups an unreachable engine cut short run again instead of being dropped."""

import asyncio
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tandem.config import RolloutConfig, RunConfig
from tandem.engine.client import EngineUnreachable
from tandem.rollout import manager as manager_module
from tandem.rollout.manager import ENGINE_RETRIES, RolloutManager
from tandem.rollout.random_agent import RandomAgentEnv
from tandem.run import checkpoint
from tandem.run.loop import CHECKPOINT, Run
from tandem.run.main import main as run_main
from tandem.types import FinishReason, GenerateOutput

TINY = ["rollout.batch_groups=2", "rollout.group_size=2", "rollout.num_in_flight=8", "random_agent.prompt_len_max=20",
        "random_agent.response_len_median=4", "random_agent.response_len_max=16", "random_agent.max_context=128",
        "random_agent.tool_latency_s=0.01", "checkpoint_every=1"]


def tandem_run(out_dir, *overrides) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tandem.cli", "run", f"out_dir={out_dir}", *TINY, *overrides],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def steps_recorded(out_dir) -> list[int]:
    path = out_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def stop_after(proc: subprocess.Popen, out_dir, steps: int, sig: int) -> int:
    deadline = time.monotonic() + 120
    while len(steps_recorded(out_dir)) < steps:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.05)
    proc.send_signal(sig)
    return proc.wait(timeout=60)


def test_killed_and_terminated_runs_resume_with_every_step_recorded_once(tmp_path):
    """SIGKILL after step 2 (nothing saved but the periodic checkpoints), resume, SIGTERM after step 4 (the run
    saves and exits 143), resume to the end: the records are steps 1..6, once each, and the checkpoint is at 6."""
    assert stop_after(tandem_run(tmp_path, "steps=6"), tmp_path, 2, signal.SIGKILL) == -signal.SIGKILL
    killed_at = torch.load(tmp_path / CHECKPOINT, weights_only=True)["trainer"]["version"]
    assert killed_at >= 1
    assert stop_after(tandem_run(tmp_path, "steps=6", "resume=true"), tmp_path, 4, signal.SIGTERM) == 143
    assert torch.load(tmp_path / CHECKPOINT, weights_only=True)["trainer"]["version"] >= 4
    # the last resume in this process, through the function `tandem run` calls (it raises where the command would
    # exit non-zero), without a third interpreter start
    run_main(None, [f"out_dir={tmp_path}", *TINY, "steps=6", "resume=true"])
    assert steps_recorded(tmp_path) == [1, 2, 3, 4, 5, 6]
    assert torch.load(tmp_path / CHECKPOINT, weights_only=True)["trainer"]["version"] == 6


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="resume: no checkpoint.pt in"):
        Run(RunConfig.load(None, [f"out_dir={tmp_path}", "resume=true"]))


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path, monkeypatch):
    """Resuming reads tensors and plain data only: a crafted checkpoint's objects are refused, never built."""
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / CHECKPOINT, "wb") as f:
        pickle.dump({"trainer": _Boom()}, f)
    run = Run(RunConfig.load(None, [f"out_dir={tmp_path}", "resume=true", "steps=1"]))
    try:
        with pytest.raises(pickle.UnpicklingError):
            asyncio.run(run.train())
    finally:
        run.shutdown()
    assert not (tmp_path / "pwned").exists()


class _FlakyEngine:
    """Unreachable for the first `failures` calls, then answers every request with one token."""

    def __init__(self, failures: int):
        self.failures = failures

    async def generate(self, input_ids, sampling=None, rid=None):
        await asyncio.sleep(0)
        if self.failures > 0:
            self.failures -= 1
            raise EngineUnreachable("engine process pid 1 at http://x: connection refused")
        return GenerateOutput("r", [5], [-1.0], [0], FinishReason("length", length=1), len(input_ids), 0)


@pytest.mark.parametrize("failures, dropped", [(2, 0), (100, 1)])
def test_groups_the_engine_could_not_serve_run_again(monkeypatch, caplog, failures, dropped):
    """A group whose episodes failed because the engine was unreachable is run again after a back-off (and listed
    for re-running by a checkpoint taken meanwhile), its log naming why; only after ENGINE_RETRIES runs is it
    dropped, with that reason."""
    monkeypatch.setattr(manager_module, "RETRY_DELAY_S", 0.01)
    cfg = RunConfig.load(None, ["random_agent.turns_max=1", "random_agent.turns_min=1"])
    rollout = RolloutConfig(group_size=1, batch_groups=1, num_in_flight=1, max_staleness=0)

    async def go():
        m = RolloutManager(_FlakyEngine(failures), lambda seed, j: RandomAgentEnv(cfg.random_agent, 64, seed, j),
                           rollout, 128, 0, lambda: 0)
        m.fill()
        for _ in range(200):
            await asyncio.sleep(0.005)
            if m._retrying:
                assert 0 in m.state_dict()["rerun"]  # a checkpoint now would run it again
            m.fill()
            if m.buffer or m.dropped:
                break
        return m

    m = asyncio.run(go())
    assert "could not be reached (engine process pid 1 at http://x: connection refused)" in caplog.text
    assert sum(m.dropped.values()) == dropped
    if dropped:
        assert list(m.dropped) == [f"the engine could not be reached in {ENGINE_RETRIES} runs of the group"]
    else:
        assert list(m.buffer) == [0] and m._engine_failures[0] == failures


def test_a_resume_drops_the_records_of_steps_after_its_checkpoint(tmp_path):
    """Steps trained after the checkpoint a crash went back to are trained again: their old records go."""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    stub = type("Stub", (), {"out_dir": tmp_path})()
    Run._keep_records_upto(stub, 3)
    assert steps_recorded(tmp_path) == [1, 2, 3]
    Run._keep_records_upto(stub, 0)  # a fresh run: a fresh record
    assert steps_recorded(tmp_path) == []


@pytest.mark.parametrize("outcome", ["finishes", "fails"])
def test_a_run_stopped_while_a_step_trains_saves_that_step_or_gives_its_batch_back(tmp_path, outcome):
    """Cancelled while the trainer's step runs in its thread: the run waits for the step before saving. A step
    that finishes is recorded and its batch counted; one that fails hands its batch back, so the checkpoint's
    taken batches equal the trained version and its groups are buffered for the resume."""
    run = Run(RunConfig.load(None, [f"out_dir={tmp_path}", "steps=5", *TINY]))
    step, started = run.trainer.step, []

    def slow_step(batch):
        started.append([g.index for g in batch])
        if len(started) == 2:
            time.sleep(0.5)
            if outcome == "fails":
                raise RuntimeError("the step failed")
        return step(batch)

    run.trainer.step = slow_step

    async def go():
        task = asyncio.create_task(run.train())
        while len(started) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(go())
    finally:
        run.shutdown()
    state = torch.load(tmp_path / CHECKPOINT, weights_only=True)
    version, manager = state["trainer"]["version"], state["manager"]
    assert manager["batches_taken"] == version == (2 if outcome == "finishes" else 1)
    if outcome == "fails":
        assert set(started[1]) <= set(manager["buffer"]), "the untrained batch's groups must be kept"
    assert steps_recorded(tmp_path) == list(range(1, version + 1))


def test_a_step_whose_engine_calls_fail_after_training_is_still_recorded(tmp_path):
    """Trained, then the engine could not be reached (its stats call failed): the step's record is written all the
    same, so a resume from the checkpoint (at that step) leaves no gap in metrics.jsonl."""
    run = Run(RunConfig.load(None, [f"out_dir={tmp_path}", "steps=5", *TINY]))
    get_stats, calls = run.engine.get_stats, []

    async def failing_stats():
        calls.append(1)
        if len(calls) == 3:  # (the first call is the run's start; then one per step)
            raise EngineUnreachable("engine at http://x: GET /engine_stats: connection refused")
        return await get_stats()

    run.engine.get_stats = failing_stats
    try:
        with pytest.raises(EngineUnreachable):
            asyncio.run(run.train())
    finally:
        run.shutdown()
    assert steps_recorded(tmp_path) == [1, 2]
    assert torch.load(tmp_path / CHECKPOINT, weights_only=True)["trainer"]["version"] == 2


@pytest.mark.parametrize("fits", [True, False], ids=["copied", "live"])
def test_a_step_checkpoint_is_written_beside_the_run(tmp_path, monkeypatch, fits):
    """A step's checkpoint is written by a thread: for a GPU model (float32 masters and the optimizer's state) the
    write takes seconds, and on the event loop it would hold every agent's turn, and so the engine's work, as long.
    Where host memory holds a copy of the state, the trainer goes on during the write too, and what is written stays
    the state of its step; where it does not, the live tensors are written and the next step waits. Each write here
    waits (at most a few seconds) for the trainer to go past the step it writes, while a task of the loop ticks."""
    monkeypatch.setattr(checkpoint, "fits_in_host_memory", lambda state: fits)
    steps = 3
    run = Run(RunConfig.load(None, [f"out_dir={tmp_path}", f"steps={steps}", *TINY]))
    write, ticks, writes = run._write_checkpoint, [0], []

    def weights(state):
        return [t.clone() for t in state["trainer"]["model"].values()]

    def slow_write(state):
        version, before = state["trainer"]["version"], ticks[0]
        if version < steps:  # (the last step's, and the run's end, have no step after them)
            taken, deadline = weights(state), time.monotonic() + (20 if fits else 2)
            while run.trainer.version <= version and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)
            unchanged = all(torch.equal(a, b) for a, b in zip(taken, weights(state), strict=True))
            writes.append((version, run.trainer.version > version, unchanged, ticks[0] - before))
        write(state)

    async def main():
        async def tick():
            while True:
                await asyncio.sleep(0.01)
                ticks[0] += 1

        ticker = asyncio.create_task(tick())
        try:
            await run.train()
        finally:
            ticker.cancel()

    run._write_checkpoint = slow_write
    try:
        asyncio.run(main())
    finally:
        run.shutdown()
    # the trainer went past each step's version while it was written only from a copy, which that left as it was
    assert [(v, went_on, unchanged) for v, went_on, unchanged, _ in writes] == [(1, fits, True), (2, fits, True)], \
        writes
    assert all(n >= 5 for *_, n in writes), writes  # the loop ticked through every write
    assert not any("slow_write" in where for _, where in run.loop_lag.holds), run.loop_lag.holds  # (nor held there)
    state = torch.load(tmp_path / CHECKPOINT, weights_only=True)
    assert state["trainer"]["version"] == steps and state["manager"]["batches_taken"] == steps


def test_a_checkpoint_copy_is_the_state_in_host_memory():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = {"trainer": {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "version": 4},
             "rng": {"torch": torch.get_rng_state(), "python": (3, (1, 2), None)}}
    copy = checkpoint.copied(state)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(copy["trainer"]["model"]["weight"], model.weight)  # a copy, not the live tensor
    assert torch.equal(copy["trainer"]["model"]["weight"] + 1.0, model.weight)
    assert copy["trainer"]["model"]._metadata == state["trainer"]["model"]._metadata
    live = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(copy["trainer"]["optimizer"]["state"][0]["exp_avg"], live)
    assert copy["trainer"]["optimizer"]["state"][0]["exp_avg"].data_ptr() != live.data_ptr()
    assert copy["trainer"]["optimizer"]["param_groups"] == state["trainer"]["optimizer"]["param_groups"]
    assert copy["rng"]["python"] == (3, (1, 2), None) and copy["trainer"]["version"] == 4
    assert checkpoint.tensor_bytes(state) == 4 * (6 + 2) * 3 + 4 * 2 + state["rng"]["torch"].numel()


def test_a_checkpoint_written_after_the_next_batch_was_taken_keeps_its_groups(tmp_path):
    """A step's end (which checkpoints) goes on beside the wait for the next batch, so the next batch may be handed
    out first. Every checkpoint must still be one a resume loses nothing from: its taken batches equal the trained
    version, and every group admitted is trained by then, buffered, to be run again or dropped. (The soak found
    four groups lost when the trainer was killed after such a checkpoint.) The step's end is slowed here, so the
    next batch is surely taken first."""
    run = Run(RunConfig.load(None, [f"out_dir={tmp_path}", "steps=4", *TINY]))
    get_stats, take, write, trained, saved = run.engine.get_stats, run._checkpoint_state, run._write_checkpoint, [], []

    async def slow_stats():
        await asyncio.sleep(0.3)
        return await get_stats()

    def checked_state():
        state = take()
        saved.append({"version": state["trainer"]["version"], "manager": state["manager"],
                      "taken": run.manager.batches_taken})
        return state

    def checked_write(state):  # what is written is the state taken
        write(state)
        assert torch.load(tmp_path / CHECKPOINT, weights_only=True)["manager"] == state["manager"]

    run.engine.get_stats, run._checkpoint_state, run._write_checkpoint = slow_stats, checked_state, checked_write
    run.on_batch = lambda version, batch: trained.append((version, [g.index for g in batch]))
    try:
        asyncio.run(run.train())
    finally:
        run.shutdown()
    assert any(s["taken"] > s["version"] for s in saved), "no checkpoint came after the next batch was taken"
    for s in saved:
        m = s["manager"]
        done = {i for version, ids in trained if version < s["version"] for i in ids}
        kept = done | {int(i) for i in m["buffer"]} | set(m["rerun"]) | set(m["dropped_indices"])
        assert m["batches_taken"] == s["version"] and kept == set(range(m["next_index"])), (s, trained)


def test_the_runs_last_checkpoint_is_written_from_a_copy_off_the_event_loop(tmp_path):
    """The run's end writes its checkpoint as a step's: from a host copy (a device tensor's storage copied by
    `torch.save` keeps the interpreter's lock, and a colocated engine's thread waits), by a thread."""
    run = Run(RunConfig.load(None, [f"out_dir={tmp_path}", "steps=2", *TINY]))
    write, writes = run._write_checkpoint, []

    def recorded_write(state):
        live = dict(run.trainer.state_dict()["model"])
        copied = all(state["trainer"]["model"][k].data_ptr() != t.data_ptr() for k, t in live.items())
        writes.append((state["trainer"]["version"], threading.current_thread() is threading.main_thread(), copied))
        write(state)

    run._write_checkpoint = recorded_write
    try:
        asyncio.run(run.train())
    finally:
        run.shutdown()
    assert writes[-1] == (2, False, True), writes  # (the last: the run's end)
    assert torch.load(tmp_path / CHECKPOINT, weights_only=True)["trainer"]["version"] == 2
