"""`LoopLag`: a hold of the run's event loop is noticed, measured and located (the rollouts' agents all wait on it,
and nothing else reports it); a loop that only awaits has none."""

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
