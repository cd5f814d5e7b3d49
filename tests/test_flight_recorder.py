"""Flight recorder, watchdog and fault plan in one process: record fields, journal rotation, file names (restarts,
hostile ids), dumps that never touch the device, idle pauses, SIGUSR1. Each protection has a mutation test: the same
check, run with the protection removed, must fail. The multi-process hang tests are in test_forensics.py."""

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from tandem.distributed import faults
from tandem.distributed import flight_recorder as fr
from tandem.distributed.analyzer import NAME_RE, analyze
from tandem.distributed.faults import FaultPlan
from tandem.distributed.flight_recorder import FlightRecorder, sanitize_id
from tandem.distributed.watchdog import Watchdog, install_handlers


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


# --- tests -----------------------------------------------------------------------------------------------------------
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
    assert step["frames"] == []  # an engine step's call site never varies: no stack walk per step
    site = done["frames"][0]
    assert Path(site["filename"]).name == "test_flight_recorder.py"
    assert site["name"] == "test_records_carry_flight_recorder_fields_states_and_the_calling_site"
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
@pytest.mark.parametrize("protection", ["idle_pause", "boot_id", "sanitize"])
def test_mutation_without_the_protection_the_check_fails(protection, tmp_path, monkeypatch):
    if protection == "idle_pause":
        assert idle_engine_fires(False, tmp_path)
    elif protection == "boot_id":  # one fixed id for every boot: the restart overwrites the first dump
        assert not restart_keeps_first_boot(tmp_path, boot_id="fixed")
    elif protection == "sanitize":  # ids straight into paths
        monkeypatch.setattr(fr, "sanitize_id", lambda value, max_len=48: str(value))
        assert not hostile_ids_are_safe(tmp_path / "a" / "b")
