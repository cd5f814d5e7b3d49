"""`LoopLag`: a hold of the run's event loop is noticed, measured and located (the rollouts' agents all wait on it,
and nothing else reports it); a loop that only awaits has none. And `Run` keeps what its first step built out of
the collector's full passes, which hold the loop too."""

import asyncio
import time

from tandem.run.loop_lag import LoopLag


def hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # (what blocking code does to the loop: no task runs meanwhile)


def test_a_hold_is_measured_and_located(caplog):
    async def main() -> LoopLag:
        lag = LoopLag(held_s=0.1, tick_s=0.02).start()
        await asyncio.sleep(0.1)
        hold_the_loop(0.4)
        await asyncio.sleep(0.1)
        lag.stop()
        return lag

    lag = asyncio.run(main())
    assert len(lag.holds) == 1, lag.holds
    held, where = lag.holds[0]
    assert 0.3 < held < 1.0 and lag.longest_s == held
    assert where.startswith("hold_the_loop (test_loop_lag.py:"), where
    assert "the event loop was held" in caplog.text and "hold_the_loop" in caplog.text


def test_a_loop_that_awaits_has_no_holds():
    async def main() -> LoopLag:
        lag = LoopLag(held_s=0.1, tick_s=0.02).start()
        for _ in range(20):
            await asyncio.sleep(0.02)
        lag.stop()
        return lag

    assert asyncio.run(main()).holds == []


def test_a_run_records_the_holds_of_its_event_loop(tmp_path):
    """`Run` watches its event loop while it trains: a step's end that blocks the loop (here the step callback, which
    runs on it) shows in the later records' counts, and the hold's report names where it was held."""
    from tandem.config import RunConfig
    from tandem.run.loop import Run

    run = Run(RunConfig.load(None, [f"out_dir={tmp_path}", "steps=2", "checkpoint_every=0",
                                    "rollout.batch_groups=2", "rollout.group_size=2"]))

    def hold_on_step(record: dict) -> None:
        if record["step"] == 1:
            hold_the_loop(0.5)

    try:
        history = asyncio.run(run.train(on_step=hold_on_step))
    finally:
        run.shutdown()
    assert history[-1]["loop_holds"] >= 1 and history[-1]["loop_longest_hold_s"] > 0.4, history[-1]
    assert any(where.startswith("hold_the_loop") and "_finish_step (loop.py:" in where
               for _, where in run.loop_lag.holds), run.loop_lag.holds


def test_a_run_leaves_what_its_first_step_built_out_of_the_collectors_passes(tmp_path):
    """The heap is frozen again once the first step is trained (a compiled step's caches are built there, and a full
    pass over them holds every thread of the process): more objects are frozen at its end than before it."""
    import gc

    from tandem.config import RunConfig
    from tandem.run.loop import Run

    run = Run(RunConfig.load(None, [f"out_dir={tmp_path}", "steps=2", "checkpoint_every=0",
                                    "rollout.batch_groups=2", "rollout.group_size=2"]))
    frozen: dict[str, int] = {}
    run.on_batch = lambda version, batch: frozen.setdefault("before", gc.get_freeze_count()) if version == 0 else None
    try:
        asyncio.run(run.train(on_step=lambda r: frozen.setdefault("after", gc.get_freeze_count())))
    finally:
        run.shutdown()
        gc.unfreeze()
    assert frozen["after"] > frozen["before"], frozen
