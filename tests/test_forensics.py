"""Hang forensics: flight recorder, watchdog, analyzer and fault injection, over real gloo processes (2 and 3 ranks)
and in-process for the parts that need no peers.

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
import json
import logging
import os
import queue
import re
import signal
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.torch_version import TorchVersion

from tandem.distributed import collectives, faults
from tandem.distributed import flight_recorder as fr
from tandem.distributed.analyzer import NAME_RE, analyze, export_torch, main
from tandem.distributed.faults import FaultPlan
from tandem.distributed.flight_recorder import FlightRecorder, sanitize_id
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
    """`world_size` spawned ranks that run trials on request; always joined, then terminated, then killed."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
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
def wait_for_dumps(directory: Path, world_size: int, reason: str, timeout_s: float) -> dict[int, dict]:
    """rank -> its first dump whose reason starts with `reason`, as soon as every rank has one, or at the timeout."""
    found, deadline = {}, time.monotonic() + timeout_s
    while len(found) < world_size and time.monotonic() < deadline:
        for path in sorted(directory.glob("tandem_dump.*.json")):
            rank = int(NAME_RE.match(path.name)[3])
            doc = json.loads(path.read_text())
            if rank not in found and doc["reason"].startswith(reason):
                found[rank] = doc
        time.sleep(0.05)
    return found


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


# --- in-process tests ------------------------------------------------------------------------------------------------
def test_records_carry_flight_recorder_fields_states_and_the_calling_site(tmp_path):
    recorder = FlightRecorder(0, tmp_path, boot_id="b", capacity=8)
    with recorder.engine_step(7, batch=2):
        with recorder.recorded("tp", "all_reduce", [torch.ones(2, 3, dtype=torch.bfloat16)]):
            pass
        with pytest.raises(ValueError), recorder.recorded("tp", "broadcast", [torch.ones(1)]):
            raise ValueError("boom")
    step, done, failed = recorder.entries()
    assert (done["collective_seq_id"], failed["collective_seq_id"], step["collective_seq_id"]) == (0, 1, 0)
    assert done["profiling_name"] == "tp:all_reduce" and done["process_group"] == ["tp", "tp"]
    assert (done["input_sizes"], done["input_dtypes"], done["state"]) == ([[2, 3]], ["bfloat16"], "completed")
    assert done["time_created_ns"] <= done["time_discovered_completed_ns"]
    assert (failed["state"], failed["error"]) == ("failed", "ValueError: boom")
    assert (step["kind"], step["info"], step["state"]) == ("step", {"step": 7, "batch": 2}, "completed")
    site = done["frames"][0]
    assert (Path(site["filename"]).name, site["name"]) == ("test_forensics.py", "test_records_carry_flight_recorder_"
                                                           "fields_states_and_the_calling_site")
    lines = [json.loads(line) for line in recorder.journal_path.read_text().splitlines()]
    assert [line["type"] for line in lines] == ["header", "pg", "entry", "pg", "entry", "done", "entry", "done", "done"]


def test_journal_is_bounded_and_the_analyzer_reads_both_rotation_files(tmp_path):
    recorder = FlightRecorder(0, tmp_path, boot_id="b", capacity=5)
    for _ in range(23):
        with recorder.recorded("tp", "all_reduce", [torch.ones(1)]):
            pass
    with recorder.recorded("tp", "all_reduce", [torch.ones(1)]):  # killed inside this one: never completes
        recorder.close()
    counts = [sum('"type":"entry"' in line for line in path.read_text().splitlines())
              for path in (recorder.journal_path, Path(f"{recorder.journal_path}.1"))]
    assert counts == [4, 5]  # at most 2 x capacity on disk, always at least capacity
    records = analyze(tmp_path).ranks[0]
    assert sorted(e["collective_seq_id"] for e in records.entries.values()) == list(range(15, 24))
    assert records.last("collective")["state"] == "scheduled"


HOSTILE_IDS = ["../../x", "a/b;c", "x" * 300, "..", "", "a\0b", "C:\\evil", "-rf"]


def hostile_ids_are_safe(directory: Path) -> bool:
    """Every hostile id gives a distinct file of the expected shape, directly inside `directory`."""
    names = set()
    for boot_id in HOSTILE_IDS:
        try:
            recorder = FlightRecorder(0, directory, boot_id=boot_id, journal=False)
            path = recorder.dump("test")
        except (OSError, ValueError):
            return False
        ok = path.resolve().parent == directory.resolve() and NAME_RE.match(path.name) and len(path.name) < 100
        names.add(path.name)
        if not ok:
            return False
    return len(names) == len(HOSTILE_IDS)


def test_hostile_ids_give_safe_distinct_names(tmp_path):
    for boot_id in HOSTILE_IDS:
        safe = sanitize_id(boot_id)
        assert 0 < len(safe) <= 48 and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_-]*", safe), safe
    assert hostile_ids_are_safe(tmp_path / "a" / "b")


def restart_keeps_first_boot(directory: Path, boot_id=None) -> bool:
    """Two boots of rank 0 in one directory: the first boot's journal and dump survive the second's."""
    first = FlightRecorder(0, directory, boot_id=boot_id)
    with first.recorded("tp", "all_reduce", [torch.ones(1)]):
        pass
    first.close()
    first_files = {p.name: p.read_bytes() for p in directory.iterdir()} | {"dump": first.dump("boot 1").read_bytes()}
    time.sleep(0.002)
    second = FlightRecorder(0, directory, boot_id=boot_id)
    with second.recorded("tp", "broadcast", [torch.ones(2)]):
        pass
    second.dump("boot 2")
    return (first_files.pop("dump") == first.path(fr.DUMP, 0).read_bytes()
            and all((directory / name).read_bytes() == data for name, data in first_files.items()))


def test_restart_keeps_the_previous_boots_files_and_the_analyzer_reads_either(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_BOOT_ID", raising=False)
    assert restart_keeps_first_boot(tmp_path)
    boots = sorted({NAME_RE.match(p.name)[2] for p in tmp_path.iterdir()})
    assert len(boots) == 2
    newest = analyze(tmp_path).ranks[0]
    oldest = min(boots, key=lambda b: analyze(tmp_path, boot=b).ranks[0].time_boot_ns)
    assert newest.boot_id != oldest and newest.last("collective")["profiling_name"] == "tp:broadcast"
    assert analyze(tmp_path, boot=oldest).ranks[0].last("collective")["profiling_name"] == "tp:all_reduce"


def test_a_reused_boot_id_overwrites_nothing_and_the_analyzer_takes_the_newest_boot(tmp_path):
    for op in ("all_reduce", "broadcast"):
        recorder = FlightRecorder(0, tmp_path, boot_id="fixed")
        with recorder.recorded("tp", op, [torch.ones(1)]):
            pass
        recorder.dump(op)
        time.sleep(0.002)
    assert len(list(tmp_path.glob("tandem_dump.fixed.rank0.*.json"))) == 2
    records = analyze(tmp_path).ranks[0]
    assert [e["profiling_name"] for e in records.entries.values()] == ["tp:broadcast"]
    assert [d["reason"] for d in records.dumps] == ["broadcast"]


def test_dumps_never_read_device_memory(tmp_path):
    """Meta tensors have no data: any .tolist()/.item()/.cpu() in recording or dumping would raise."""
    recorder = FlightRecorder(0, tmp_path, boot_id="b")
    with recorder.recorded("tp", "all_reduce", [torch.empty(4, 8, device="meta")]):
        pass
    watchdog = Watchdog(recorder, 60)
    watchdog.add_state("sentinel", lambda: {"digest": torch.empty(3, device="meta"), "step": 5})
    doc = json.loads(watchdog.dump("test").read_text())
    assert doc["state"]["sentinel"] == {"digest": {"shape": [3], "dtype": "torch.float32", "device": "meta"}, "step": 5}
    assert doc["entries"][0]["input_sizes"] == [[4, 8]]
    assert "test_dumps_never_read_device_memory" in (tmp_path / doc["stacks_file"]).read_text()


@pytest.mark.gpu
def test_dump_does_not_wait_for_a_busy_gpu(tmp_path):
    """A dump while the GPU is busy for seconds (as a hung kernel would keep it) returns at once; reading a value of
    the same tensor, the mutation, waits for the GPU."""
    x = torch.ones(1024, device="cuda")
    recorder = FlightRecorder(0, tmp_path, boot_id="b")
    with recorder.recorded("tp", "all_reduce", [x]):
        pass
    watchdog = Watchdog(recorder, 60)
    watchdog.add_state("sentinel", lambda: {"digest": x})
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e9))  # ~2 s of GPU cycles on the default stream
    t0 = time.perf_counter()
    doc = json.loads(watchdog.dump("test").read_text())
    dump_s, busy = time.perf_counter() - t0, not torch.cuda.current_stream().query()
    x.sum().item()  # a value read must wait for the GPU
    read_s = time.perf_counter() - t0 - dump_s
    assert busy and dump_s < 0.5 < read_s, (dump_s, read_s)
    assert doc["state"]["sentinel"]["digest"] == {"shape": [1024], "dtype": "torch.float32", "device": "cuda:0"}


def test_watchdog_dumps_once_per_stall_rearms_on_progress_and_can_abort(tmp_path):
    aborted = threading.Event()
    recorder = FlightRecorder(0, tmp_path, boot_id="b")
    with Watchdog(recorder, 0.2, poll_s=0.02, action="abort", abort=aborted.set) as watchdog:
        assert aborted.wait(2.0)
        time.sleep(0.3)
        assert watchdog.num_fired == 1  # one dump per stall, not one per poll
        watchdog.bump()
        deadline = time.monotonic() + 2.0
        while watchdog.num_fired < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert watchdog.num_fired == 2
    assert len(list(tmp_path.glob("tandem_dump.*"))) == len(list(tmp_path.glob("tandem_stacks.*"))) == 2


def idle_engine_fires(use_idle: bool, tmp_path: Path) -> bool:
    """An engine that steps, then waits 4x the timeout for work, then steps again: does the watchdog fire?"""
    watchdog = Watchdog(FlightRecorder(0, tmp_path, boot_id=f"idle{use_idle}"), 0.1, poll_s=0.01)
    with watchdog:
        for _ in range(2):
            watchdog.bump()
            if use_idle:
                with watchdog.idle():
                    time.sleep(0.3)
            else:
                time.sleep(0.3)
    return watchdog.num_fired > 0


def test_idle_engine_never_raises_a_false_alarm(tmp_path):
    assert not idle_engine_fires(True, tmp_path)


def test_sigusr1_dumps_in_process_and_uninstall_restores(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    watchdog = Watchdog(FlightRecorder(0, tmp_path, boot_id="b"), 60, poll_s=0.02)
    handlers = install_handlers(watchdog, fatal=False)
    try:
        with watchdog:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert wait_for_dumps(tmp_path, 1, "signal SIGUSR1", 2.0)
    finally:
        handlers.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_fault_plan_parses_validates_and_flips_deterministically():
    plan = FaultPlan.from_env({"TANDEM_FAULTS": "rank=1, action=delay, seq=2, group=tp, delay_s=0.05"})
    assert plan == FaultPlan(rank=1, action="delay", seq=2, group="tp", delay_s=0.05)
    assert not FaultPlan.from_env({}).active
    for bad, field in [("rank=1,action=explode", "action"), ("sequence=3", "sequence"), ("seq=x", "seq")]:
        with pytest.raises(ValueError, match=field):
            FaultPlan.parse(bad)
    faults.configure(plan)
    try:
        assert not faults.before_collective(1, ("1", "ctrl"), 2)  # another group
        t0 = time.monotonic()
        assert not faults.before_collective(1, ("1", "tp"), 2) and time.monotonic() - t0 >= 0.05
        t0 = time.monotonic()
        assert not faults.before_collective(1, ("1", "tp"), 2) and time.monotonic() - t0 < 0.05  # once only
    finally:
        faults.configure(FaultPlan())
    flips = FaultPlan(flip_rank=1, flip_prob=0.1, flip_seed=7)
    draws = [faults.should_flip(step, 1, flips) for step in range(5000)]
    assert draws == [faults.should_flip(step, 1, flips) for step in range(5000)]
    assert 400 < sum(draws) < 600 and not any(faults.should_flip(step, 0, flips) for step in range(5000))


# --- mutations: each protection removed, the check that proves it must fail ------------------------------------------
@pytest.mark.parametrize("protection", ["watchdog", "journal", "signal_wakeup", "idle_pause", "boot_id", "sanitize"])
def test_mutation_without_the_protection_the_check_fails(protection, request, tmp_path, monkeypatch):
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
    elif protection == "idle_pause":
        assert idle_engine_fires(False, tmp_path)
    elif protection == "boot_id":  # one fixed id for every boot: the restart overwrites the first dump
        assert not restart_keeps_first_boot(tmp_path, boot_id="fixed")
    elif protection == "sanitize":  # ids straight into paths
        monkeypatch.setattr(fr, "sanitize_id", lambda value, max_len=48: str(value))
        assert not hostile_ids_are_safe(tmp_path / "a" / "b")
