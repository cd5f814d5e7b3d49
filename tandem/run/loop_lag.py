"""Notices when a run's event loop is held, and says where.

Everything the rollouts do runs on the trainer process's event loop: the agents' turns, the engine's replies, the
manager's admissions. Code that blocks it (a large file written on it, a long computation, a collector pass) holds
every episode and so starves the engine, without an error: only throughput shows it. `LoopLag` makes it visible. A
task of the loop wakes every `TICK_S`; a wake later than `HELD_S` is a hold, logged with its length and the loop
thread's stack during it, which a watching thread takes while the loop is held (`tandem.holds`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from tandem.holds import HoldWatch

log = logging.getLogger(__name__)

TICK_S = 0.05
HELD_S = 0.2  # a hold this long is logged: every episode waited for it


class LoopLag:
    """Start with `start()` on the loop to watch, stop with `stop()`. `holds`: (seconds, where) of each hold so far."""

    def __init__(self, held_s: float = HELD_S, tick_s: float = TICK_S):
        self.held_s, self.tick_s = held_s, tick_s
        self.holds: list[tuple[float, str]] = []
        self._watch = HoldWatch(held_s + tick_s)  # (a unit: from one tick to the next)
        self._task: asyncio.Task | None = None

    def start(self) -> LoopLag:
        self._watch.begin()
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    def stop(self) -> None:
        self._watch.end()
        if self._task is not None:
            self._task.cancel()

    @property
    def longest_s(self) -> float:
        return max((s for s, _ in self.holds), default=0.0)

    async def _tick(self) -> None:
        stamp = time.monotonic()
        while True:
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            where = self._watch.end()
            self._watch.begin(now)
            if (held := now - stamp - self.tick_s) > self.held_s:
                self.holds.append((held, where := where or "(not taken)"))
                log.warning("run: the event loop was held %.0f ms; every episode waited for it; held in: %s",
                            1e3 * held, where)
            stamp = now
