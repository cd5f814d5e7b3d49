"""Says where a thread was held: while a unit of work (an engine's step, the time between two ticks of an event
loop) runs past its limit, a watching thread takes the working thread's stack, so that the warning about the unit
can name the call that held it, not only its length.

`HoldWatch.begin()` on the working thread as a unit starts, `end()` as it ends: `end` returns where that thread was
once the unit had run `held_s` (None if the unit ended sooner, or before the watcher looked). One daemon thread
per process looks at every live watch every `POLL_S`; it takes stacks only while some unit is past its limit. When
the watcher itself wakes `INTERPRETER_HELD_S` late, no thread could run Python meanwhile: that is logged with each
thread's stack as the watcher finds them, the holder's among them (it has just let go).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
import weakref

log = logging.getLogger(__name__)

POLL_S = 0.05
INTERPRETER_HELD_S = 0.2  # the watcher itself woke this late: logged, with every thread's stack
STACK_FRAMES = 5  # of tandem's own frames, innermost first, after the innermost frame of all


class HoldWatch:
    """Units of work on one thread at a time, each located on its thread's stack once past `held_s`."""

    def __init__(self, held_s: float):
        self.held_s = held_s
        self._unit: tuple[int, float] | None = None  # (thread, start) of the unit under way
        self._where: tuple[float, str] | None = None  # (the start of the unit it was taken in, where)
        _register(self)

    def begin(self, now: float | None = None) -> None:
        """A unit starts on this thread (at `now`, `time.monotonic()`'s clock, if given)."""
        self._unit = threading.get_ident(), time.monotonic() if now is None else now

    def end(self) -> str | None:
        """The unit under way ends: where its thread was once it had run `held_s`, if the watcher saw that."""
        unit, self._unit = self._unit, None
        taken = self._where
        return taken[1] if unit is not None and taken is not None and taken[0] == unit[1] else None

    def _overdue(self, now: float) -> tuple[int, float] | None:
        unit = self._unit
        if unit is None or now - unit[1] <= self.held_s or (self._where is not None and self._where[0] == unit[1]):
            return None
        return unit

    def _take(self, unit: tuple[int, float], frames: dict) -> None:
        if (frame := frames.get(unit[0])) is not None:
            self._where = unit[1], where(traceback.extract_stack(frame))


def where(stack: traceback.StackSummary) -> str:
    """The innermost frame, then the innermost of tandem's own (what called into the library that holds)."""
    ours = [f for f in stack[:-1] if "/tandem/" in f.filename][-STACK_FRAMES:]
    return " < ".join(f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})" for f in [stack[-1], *reversed(ours)])


_watches: weakref.WeakSet[HoldWatch] = weakref.WeakSet()
_lock = threading.Lock()
_watcher: threading.Thread | None = None


def _register(watch: HoldWatch) -> None:
    global _watcher
    with _lock:
        _watches.add(watch)
        if _watcher is None:
            _watcher = threading.Thread(target=_watch_all, name="tandem-holds", daemon=True)
            _watcher.start()


def _watch_all() -> None:
    while True:
        slept = time.monotonic()
        time.sleep(POLL_S)
        now = time.monotonic()
        if (late := now - slept - POLL_S) > INTERPRETER_HELD_S:
            _interpreter_held(late)
        with _lock:
            watches = list(_watches)
        overdue = [(w, unit) for w in watches if (unit := w._overdue(now)) is not None]
        if overdue:
            frames = sys._current_frames()
            for watch, unit in overdue:
                watch._take(unit, frames)
        del watches, overdue  # (no strong reference while asleep: a watch goes when its owner does)


def _interpreter_held(late: float) -> None:
    """This thread woke `late`: no thread could run Python meanwhile (a call that keeps the interpreter's lock, a
    collector pass), or the process did not run. Whoever held it has just let go: each thread's stack now names it."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    stacks = "; ".join(f"{names.get(ident, ident)}: {where(traceback.extract_stack(frame))}"
                       for ident, frame in sys._current_frames().items() if ident != me)
    log.warning("the interpreter was held %.0f ms: every thread of this process waited; threads then: %s",
                1e3 * late, stacks)


def _forked() -> None:  # a forked child has no watcher thread: the next watch starts one
    global _watcher, _lock
    _watcher, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forked)
