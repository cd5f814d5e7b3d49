"""A wait cancelled as what it waits for arrives: on Python 3.11 `asyncio.wait_for` may hand on the result and drop
the cancel when both come in one turn of the loop. `cancel_outcomes` sweeps the turn the cancel comes in."""

import asyncio
from collections.abc import Callable, Coroutine


def cancel_outcomes(make: Callable[[], tuple[Coroutine, Callable[[], None]]], turns: int) -> list[bool | None]:
    """For each of 0..`turns`-1 loop turns, in a fresh loop: `make()` gives the wait (a coroutine) and `arrive()`,
    which completes what it waits for; the wait starts, `arrive()` is called, the loop turns that many times, and
    the wait is cancelled. Each outcome: True if it ended cancelled, False if it swallowed the cancel, None if it had
    ended before the cancel came."""

    async def once(turns_after: int) -> bool | None:
        wait, arrive = make()
        waiting = asyncio.ensure_future(wait)
        await asyncio.sleep(0)  # (waiting now)
        arrive()
        for _ in range(turns_after):
            await asyncio.sleep(0)
        if not waiting.cancel():
            return None
        try:
            await waiting
        except asyncio.CancelledError:
            return True
        return False

    return [asyncio.run(once(n)) for n in range(turns)]
