"""Hang forensics: flight recorder, watchdog, analyzer and fault injection, over real gloo processes (2 and 3 ranks)
(the in-process parts are in test_flight_recorder.py).

The multi-process tests share one set of spawned ranks per world size (spawning costs seconds here); each trial builds
fresh process groups on a fresh port. A trial's workload is an engine step in miniature: an all_reduce on group "tp",
then one on group "ctrl" (the sentinel's side group), then a progress bump. A rank that skips tp #k waits in ctrl #k
while the others wait in tp #k: the deadlock a diverged rank really causes. The culprit ends it by issuing tp #k from
a helper thread once the test has looked at the evidence, so hang trials need no timeouts.

Each protection also has a mutation test: the same check, run with the protection removed, must fail.
Set TANDEM_HANG_TRIALS (default 3) to run more hang trials per world size, e.g. 10 for the issue's 10 of 10.
"""

import contextlib
import io
import logging
import os
import queue
import signal
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_flight_recorder import wait_for_dumps
from test_tp import rank_processes
from torch.torch_version import TorchVersion

from tandem.distributed import collectives, faults
from tandem.distributed.analyzer import analyze, export_torch, main
from tandem.distributed.faults import FaultPlan
from tandem.distributed.flight_recorder import FlightRecorder
from tandem.distributed.watchdog import Watchdog, install_handlers

WATCHDOG_S = 0.5
HANG_SEQ = 3  # the tp collective the culprit skips (or replaces)
NUM_STEPS = 6
DUMP_DEADLINE_S = 3.0  # how long the test waits for dumps after starting a trial (init included)
TRIALS = int(os.environ.get("TANDEM_HANG_TRIALS", "3"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the ranks (spawned processes) -----------------------------------------------------------------------------------
def rank_main(rank: int, world_size: int, inbox, outbox, heal) -> None:
    torch.set_num_threads(1)
    outbox.put((0, rank, "ready"))
    while (trial := inbox.get()) is not None:
        try:
            outbox.put((trial["id"], rank, run_trial(rank, world_size, trial, heal)))
        except BaseException as e:
            outbox.put((trial["id"], rank, {"error": f"worker crashed: {e!r}"}))


def run_trial(rank: int, world_size: int, trial: dict, heal) -> dict:
    timeout = timedelta(seconds=trial["pg_timeout_s"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{trial['port']}", rank=rank,
                            world_size=world_size, timeout=timeout)
    tp, ctrl = (dist.new_group(group_desc=desc, timeout=timeout) for desc in ("tp", "ctrl"))
    recorder = FlightRecorder(rank, trial["dir"], boot_id=trial["boot"], world_size=world_size, capacity=64,
                              journal=trial["journal"])
    collectives.set_recorder(recorder)
    culprit = rank == trial["culprit"]
    if trial["fault"] in ("skip", "exit"):
        faults.configure(FaultPlan(rank=trial["culprit"], action=trial["fault"], seq=HANG_SEQ, group="tp", exit_code=3))
    if trial["fault"] == "skip" and culprit:  # the way out of the deadlock, once the test has seen the evidence
        threading.Thread(target=lambda: heal.get() and dist.all_reduce(torch.ones(4), group=tp), daemon=True).start()
    watchdog = Watchdog(recorder, WATCHDOG_S, enabled=trial["watchdog"], poll_s=0.05)
    handlers = install_handlers(watchdog, wakeup=trial["wakeup"])
    error = None
    try:
        with watchdog, watchdog.dump_on_error():
            for step in range(NUM_STEPS):
                with recorder.engine_step(step):
                    x = torch.ones(4)
                    if trial["fault"] == "mismatch" and culprit and step == HANG_SEQ:
                        collectives.broadcast(x, src=0, group=tp)
                    else:
                        collectives.all_reduce(x, group=tp)
                    collectives.all_reduce(torch.tensor([float(step)]), group=ctrl)
                    time.sleep(trial.get("step_s", 0.0))  # the step's compute
                watchdog.bump()
    except RuntimeError as e:
        error = str(e)[:200]
    finally:
        handlers.uninstall()
        recorder.close()
        collectives.set_recorder(None)
        faults.configure(FaultPlan())
        dist.destroy_process_group()
    return {"error": error}


class Ranks:
    """`world_size` rank processes (forked from test_tp's fork server, which imported torch once) that run trials
    on request; always joined, then terminated, then killed."""

    def __init__(self, world_size: int):
        ctx = rank_processes()
        self.world_size, self.num_trials = world_size, 0
        self.inboxes, self.outbox, self.heal = [ctx.Queue() for _ in range(world_size)], ctx.Queue(), ctx.Queue()
        self.procs = [ctx.Process(target=rank_main, args=(rank, world_size, self.inboxes[rank], self.outbox, self.heal),
                                  daemon=True) for rank in range(world_size)]
        for p in self.procs:
            p.start()
        self._collect(0, range(world_size), time.monotonic() + 120)  # spawning is slow: keep it out of the trials

    def _collect(self, trial_id: int, ranks, deadline: float) -> dict[int, object]:
        results = {}
        while len(results) < len(ranks):
            assert time.monotonic() < deadline, f"trial {trial_id}: only {sorted(results)} of {list(ranks)} answered"
            try:
                got_id, rank, result = self.outbox.get(timeout=0.5)
            except queue.Empty:
                assert all(self.procs[rank].is_alive() for rank in ranks), f"trial {trial_id}: a rank died"
                continue
            if got_id == trial_id:
                results[rank] = result
        return results

    def run(self, directory: Path, during=None, expect_dead=(), **spec) -> tuple[object, dict[int, dict]]:
        """Run one trial; `during(trial)` runs while it does (for a hang: while the ranks are stuck). Returns what
        `during` returned and {rank: result} from the ranks that are not in `expect_dead`."""
        self.num_trials += 1
        trial = {"id": self.num_trials, "port": free_port(), "dir": str(directory), "boot": f"t{self.num_trials}",
                 "culprit": 1, "fault": "skip", "watchdog": True, "journal": True, "wakeup": True,
                 "pg_timeout_s": 30.0, **spec}
        for inbox in self.inboxes:
            inbox.put(trial)
        try:
            seen = during(trial) if during else None
        finally:
            if trial["fault"] == "skip":
                self.heal.put(trial["id"])
        alive = [rank for rank in range(self.world_size) if rank not in expect_dead]
        return seen, self._collect(trial["id"], alive, time.monotonic() + trial["pg_timeout_s"] + 30)

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def ranks2():
    ranks = Ranks(2)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def ranks3():
    ranks = Ranks(3)
    yield ranks
    ranks.close()


# --- checks shared by the tests and their mutations ------------------------------------------------------------------
def hang_problems(trial: dict, world_size: int) -> list[str]:
    """While the ranks hang: did every rank dump within 2x the watchdog timeout of its last progress, and does the
    analyzer name the culprit and the sequence number? Returns what went wrong."""
    dumps = wait_for_dumps(Path(trial["dir"]), world_size, "watchdog", DUMP_DEADLINE_S)
    problems = [f"rank {rank} did not dump" for rank in range(world_size) if rank not in dumps]
    for rank, doc in sorted(dumps.items()):
        lag_s = (doc["time_dump_ns"] - doc["state"]["watchdog"]["last_progress_ns"]) / 1e9
        if lag_s > 2 * WATCHDOG_S:
            problems.append(f"rank {rank} dumped {lag_s:.2f}s after its last progress")
    verdict = analyze(trial["dir"])
    if (verdict.kind, verdict.culprits, verdict.pg, verdict.seq) != ("missing", (trial["culprit"],), "tp", HANG_SEQ):
        problems.append(f"wrong verdict:\n{verdict.text()}")
    with contextlib.redirect_stdout(io.StringIO()) as out:  # what `tandem analyze` prints: the verdict first
        status = main([trial["dir"]])
    expected = f"VERDICT: rank(s) [{trial['culprit']}] never issued collective #{HANG_SEQ} of process group 'tp'"
    if status != 1 or not out.getvalue().startswith(expected):
        problems.append(f"tandem analyze exited {status} and printed:\n{out.getvalue()}")
    return problems


# --- multi-process tests ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3])
def test_hang_every_rank_dumps_and_the_analyzer_names_culprit_and_seq(world_size, request, tmp_path):
    ranks = request.getfixturevalue(f"ranks{world_size}")
    # with two ranks a tie is broken in favour of rank 0 (the leader), so the culprit must be rank 1
    culprits = [1] * TRIALS if world_size == 2 else [i % world_size for i in range(TRIALS)]
    for i, culprit in enumerate(culprits):
        problems, results = ranks.run(tmp_path / f"trial{i}", culprit=culprit,
                                      during=lambda trial: hang_problems(trial, world_size))
        assert problems == [], f"trial {i} (culprit {culprit}): {problems}"
        assert all(r["error"] is None for r in results.values()), results  # healed: the group is usable again


def sigusr1_dumped_while_blocked(ranks: Ranks, trial: dict) -> bool:
    """During the hang: SIGUSR1 to rank 0 gives a dump that shows it still blocked in tp #HANG_SEQ."""
    wait_for_dumps(Path(trial["dir"]), ranks.world_size, "watchdog", DUMP_DEADLINE_S)  # the ranks are stuck now
    os.kill(ranks.procs[0].pid, signal.SIGUSR1)
    dumps = wait_for_dumps(Path(trial["dir"]), 1, "signal SIGUSR1", 2.0)
    if 0 not in dumps:
        return False
    last = dumps[0]["entries"][-1]
    return (last["process_group"][1], last["collective_seq_id"], last["state"]) == ("tp", HANG_SEQ, "scheduled")


def test_sigusr1_dumps_while_the_main_thread_is_blocked_in_a_collective(ranks2, tmp_path):
    seen, _ = ranks2.run(tmp_path, during=lambda trial: sigusr1_dumped_while_blocked(ranks2, trial))
    assert seen is True


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_issuing_a_different_op_at_the_same_seq_is_named(world_size, request, tmp_path, caplog):
    ranks = request.getfixturevalue(f"ranks{world_size}")
    _, results = ranks.run(tmp_path, fault="mismatch", culprit=1, pg_timeout_s=1.5)
    assert all(r["error"] for r in results.values()), results  # gloo times out on both ops
    verdict = analyze(tmp_path)
    assert (verdict.kind, verdict.culprits, verdict.pg, verdict.seq) == ("mismatch", (1,), "tp", HANG_SEQ), \
        verdict.text()
    assert "gloo:broadcast" in verdict.headline and "gloo:all_reduce" in verdict.headline
    reasons = {rank: [d["reason"] for d in records.dumps] for rank, records in verdict.ranks.items()}
    for rank in range(world_size):  # the watchdog fired first, then the timeout's error exit dumped again
        assert any(r.startswith("watchdog") for r in reasons[rank]), reasons
        assert any(r.startswith("error exit: RuntimeError") for r in reasons[rank]), reasons
    if TorchVersion(torch.__version__) >= (2, 13):  # PyTorch's own analyzer (gloo entries from 2.13 on) agrees
        from torch.distributed.flight_recorder import fr_trace

        export_torch(tmp_path, tmp_path / "torch")
        with caplog.at_level(logging.INFO):
            fr_trace.main([str(tmp_path / "torch"), "-p", "tandem_fr_torch_"])
        assert "Culprit rank 1; Error type: COLLECTIVE_TYPE_MISMATCH" in caplog.text


def test_dead_rank_is_named_from_the_survivors_and_its_own_journal(tmp_path):
    ranks = Ranks(2)
    try:
        _, results = ranks.run(tmp_path, fault="exit", expect_dead=(1,), pg_timeout_s=10.0, step_s=0.02)
        ranks.procs[1].join(timeout=10)
        assert ranks.procs[1].exitcode == 3
    finally:
        ranks.close()
    assert results[0]["error"], results
    verdict = analyze(tmp_path)
    assert (verdict.kind, verdict.culprits, verdict.pg, verdict.seq) == ("missing", (1,), "tp", HANG_SEQ), \
        verdict.text()
    dead = verdict.ranks[1]  # killed without cleanup: what it did survives in its journal alone
    assert dead.dumps == [] and dead.last("collective")["process_group"][1] == "ctrl"
    assert dead.last("collective")["collective_seq_id"] == HANG_SEQ - 1
    assert any("rank 1: never issued" in line and "it exited" in line for line in verdict.evidence), verdict.text()


# --- mutations: each protection removed, the check that proves it must fail ------------------------------------------
@pytest.mark.parametrize("protection", ["watchdog", "journal", "signal_wakeup"])
def test_mutation_without_the_protection_the_check_fails(protection, request, tmp_path):
    if protection == "watchdog":  # nobody dumps; the journal alone still names the culprit
        problems, _ = request.getfixturevalue("ranks2").run(
            tmp_path, watchdog=False, during=lambda trial: hang_problems(trial, 2))
        assert problems == ["rank 0 did not dump", "rank 1 did not dump"]
    elif protection == "journal":  # no dump and no journal: nothing left to analyze
        problems, _ = request.getfixturevalue("ranks2").run(
            tmp_path, watchdog=False, journal=False, during=lambda trial: hang_problems(trial, 2))
        assert any(p.startswith("wrong verdict") for p in problems) and analyze(tmp_path).kind == "no_data"
    elif protection == "signal_wakeup":  # the Python handler waits for the blocked main thread
        ranks2 = request.getfixturevalue("ranks2")
        seen, _ = ranks2.run(tmp_path, wakeup=False, during=lambda trial: sigusr1_dumped_while_blocked(ranks2, trial))
        assert seen is False


class _Graph:
    """A stand-in for a captured CUDA graph: counts its replays."""

    replays = 0

    def replay(self):
        self.replays += 1


def test_a_cuda_graph_capture_records_nothing_and_each_replay_is_one_record():
    """Collectives captured in a graph run on every replay without passing through `collectives`; the record of a
    replay stands for them (on the GPU, `test_tp`'s graph test checks the real thing). A planned skip of that
    record skips the whole graph, as a rank on another branch would."""
    recorder, graph = FlightRecorder(0), _Graph()
    previous = collectives.set_recorder(recorder)
    try:
        with collectives.capturing() as ops:
            assert collectives._issue("all_reduce", "tp", [], [], lambda: "ran") == "ran"
            assert collectives._issue("all_gather", "tp", [], [], lambda: "ran") == "ran"
        assert ops == ["all_reduce", "all_gather"] and recorder.entries() == []
        collectives.replay(graph, 16, ops, "tp")
        (entry,) = recorder.entries()
        assert (entry["profiling_name"], entry["input_sizes"], entry["info"]) == \
            ("tp:cuda_graph", [[16]], {"batch_size": 16, "collectives": 2})
        assert graph.replays == 1 and entry["state"] == "completed"
        faults.configure(FaultPlan(rank=0, action="skip", seq=1, group="tp"))
        collectives.replay(graph, 16, ops, "tp")
        assert graph.replays == 1 and len(recorder.entries()) == 1
        collectives.replay(graph, 16, ops, "tp")
        assert graph.replays == 2 and recorder.entries()[-1]["collective_seq_id"] == 1
    finally:
        faults.configure(None)
        collectives.set_recorder(previous)
