"""Notices when a run's event loop is held, and says where.

Everything the rollouts do runs on the trainer process's event loop: the agents' turns, the engine's replies, the
manager's admissions. Code that blocks it (a large file written on it, a long computation, a collector pass) holds
every episode and so starves the engine, without an error: only throughput shows it. `LoopLag` makes it visible. A
task of the loop wakes every `TICK_S`; a wake later than `HELD_S` is a hold, logged with its length and the loop
thread's stack during it, which a watching thread takes while the loop is held.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

log = logging.getLogger(__name__)

TICK_S = 0.05
HELD_S = 0.2  # a hold this long is logged: every episode waited for it
STACK_FRAMES = 5  # of tandem's own frames, innermost first, after the innermost frame of all


class LoopLag:
    """Start with `start()` on the loop to watch, stop with `stop()`. `holds`: (seconds, where) of each hold so far."""

    def __init__(self, held_s: float = HELD_S, tick_s: float = TICK_S):
        self.held_s, self.tick_s = held_s, tick_s
        self.holds: list[tuple[float, str]] = []
        self._stamp = time.monotonic()
        self._where: tuple[float, str] | None = None  # (the hold's stamp, the loop thread's stack during it)
        self._stopped = threading.Event()
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> LoopLag:
        loop_thread = threading.get_ident()
        self._stamp = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._tick())
        self._thread = threading.Thread(target=self._watch, args=(loop_thread,), name="tandem-loop-lag", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._task is not None:
            self._task.cancel()

    @property
    def longest_s(self) -> float:
        return max((s for s, _ in self.holds), default=0.0)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            if (held := now - self._stamp - self.tick_s) > self.held_s:
                where = self._where[1] if self._where and self._where[0] == self._stamp else "(not taken)"
                self.holds.append((held, where))
                log.warning("run: the event loop was held %.0f ms; every episode waited for it; held in: %s",
                            1e3 * held, where)
            self._stamp, self._where = now, None

    def _watch(self, loop_thread: int) -> None:
        while not self._stopped.wait(self.tick_s):
            stamp = self._stamp
            taken = self._where is not None and self._where[0] == stamp
            if not taken and time.monotonic() - stamp - self.tick_s > self.held_s:
                frame = sys._current_frames().get(loop_thread)
                if frame is not None:
                    self._where = stamp, where(traceback.extract_stack(frame))


def where(stack: traceback.StackSummary) -> str:
    """The innermost frame, then the innermost of tandem's own (what called into the library that blocks)."""
    ours = [f for f in stack[:-1] if "/tandem/" in f.filename][-STACK_FRAMES:]
    return " < ".join(f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})" for f in [stack[-1], *reversed(ours)])
