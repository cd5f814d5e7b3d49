"""The async benchmark's own parts. Its collector hook (`Collections`) must cost next to nothing: it runs at every
pass of the garbage collector, and `gc.get_freeze_count` walks every frozen object, so asking it at every pass slows
the measured trainer's process (its steps and its agents' turns). Its hold reports say which step each fell in, or
that it came after the last (the run's end, in no measured figure)."""

import importlib.util
import logging
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "async_speedup", Path(__file__).parents[1] / "benchmarks" / "async_speedup.py")
async_speedup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(async_speedup)


def test_collections_asks_for_the_freeze_count_only_until_the_heap_is_frozen(monkeypatch):
    frozen_counts = iter([0, 0, 7] + [7] * 10)
    asked = []

    def get_freeze_count():
        asked.append(1)
        return next(frozen_counts)

    monkeypatch.setattr(async_speedup.gc, "get_freeze_count", get_freeze_count)
    hook = async_speedup.Collections()
    for generation in [0, 1, 0, 2, 0, 0, 1]:
        hook("start", {"generation": generation})
        hook("stop", {"generation": generation})
    assert len(asked) == 3  # two passes before the freeze, then the first after it: never again
    summary = hook.summary()
    assert (summary["gc0"][0], summary["gc1"][0], summary["gc2"][0]) == (3, 1, 1)  # passes 3-7
    assert summary["longest_before_start_ms"] >= 0.0


def test_a_hold_is_placed_in_the_step_it_fell_in_or_after_the_last():
    holds = async_speedup.Holds("tandem.engine.core")
    for created, message in [(9.5, "engine: step 7 took 300 ms; every request waited for it"),
                             (12.0, "engine: step 9 took 250 ms; every request waited for it"),
                             (20.0, "engine: step 11 took 400 ms; every request waited for it")]:
        record = logging.LogRecord("tandem.engine.core", logging.WARNING, __file__, 1, message, None, None)
        record.created = created
        holds.emit(record)
    history = [{"step": 1, "time": 10.0}, {"step": 2, "time": 12.0}, {"step": 3, "time": 15.0}]
    assert async_speedup.placed(holds, history) == [
        "[in step 1] engine: step 7 took 300 ms; every request waited for it",
        "[in step 2] engine: step 9 took 250 ms; every request waited for it",
        "[after the last step] engine: step 11 took 400 ms; every request waited for it"]
    assert holds.ms == [300.0, 250.0, 400.0]
