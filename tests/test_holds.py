"""`tandem.holds`: a unit of work past its limit is located on its thread's stack, a unit within it is not, and a
call that keeps the interpreter's lock (every thread of the process waits on it) is logged naming the thread."""

import ctypes
import threading
import time

import pytest
import torch

from tandem.holds import HoldWatch

KEEP_THE_LOCK = ctypes.PyDLL(None).usleep  # (a PyDLL call keeps the interpreter's lock, as some C calls do)


def wait_here(seconds: float) -> None:
    time.sleep(seconds)


def keep_the_lock() -> None:
    KEEP_THE_LOCK(400_000)
    time.sleep(0.3)  # (still alive when the watcher looks)


def test_a_unit_past_its_limit_is_located_and_one_within_it_is_not():
    watch = HoldWatch(0.1)
    watch.begin()
    wait_here(0.3)
    assert watch.end().startswith("wait_here (test_holds.py:")
    watch.begin()
    wait_here(0.02)
    assert watch.end() is None
    assert watch.end() is None  # (no unit under way)


def test_a_call_that_keeps_the_interpreters_lock_is_logged_naming_its_thread(caplog):
    HoldWatch(1.0)  # (the watcher runs while a watch lives)
    worker = threading.Thread(target=keep_the_lock, name="lock-keeper")
    with caplog.at_level("WARNING", logger="tandem.holds"):
        worker.start()
        worker.join()
    held = [r.getMessage() for r in caplog.records if "the interpreter was held" in r.getMessage()]
    assert len(held) == 1 and "lock-keeper: keep_the_lock (test_holds.py:" in held[0], held
    assert 300 < int(held[0].split("held ")[1].split(" ms")[0]) < 1000, held


def longest_gap_beside(work) -> float:
    """The longest this thread went without running while `work` ran in another thread (it wakes every ms)."""
    done, gaps = threading.Event(), [0.0]
    worker = threading.Thread(target=lambda: (work(), done.set()))
    last = time.monotonic()
    worker.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
    worker.join()
    return max(gaps)


@pytest.mark.gpu
def test_a_checkpoints_copy_off_the_device_lets_other_threads_run(tmp_path):
    """Why a checkpoint is copied to host memory before `torch.save` sees it (`tandem.run.checkpoint`): the copy
    (`Tensor.to`) lets the other threads of the process run, a colocated engine's among them, where `torch.save`
    of the live device tensors keeps the interpreter's lock through each storage's copy."""
    from tandem.run import checkpoint

    state = {"masters": torch.ones(1 << 30, device="cuda")}  # 4 GiB
    torch.cuda.synchronize()
    assert longest_gap_beside(lambda: checkpoint.copied(state)) < 0.05
    assert longest_gap_beside(lambda: torch.save(state, tmp_path / "live.pt")) > 0.1
