"""Watchdog: notices that a rank's loop stopped making progress and leaves the evidence before anyone kills it.

The engine loop calls `bump()` once per step and wraps every wait that may legitimately last (no requests to serve, a
weight update being prepared elsewhere) in `with watchdog.idle():`, so an idle engine never raises a false alarm.
A thread checks every `poll_s`; once the loop has neither bumped nor been idle for `timeout_s` it dumps, in this order:
1. every Python thread's stack (faulthandler: works while the main thread is blocked inside a C++ collective),
2. the state providers (`add_state`: e.g. the lockstep sentinel's last digest; they must return host-side data
   quickly and never touch the device), then the flight recorder's ring, together in one dump file,
then, by `action`, keeps waiting ("wait": one dump per stall, re-armed by progress) or calls `abort` ("abort":
default `os._exit(ABORT_EXIT_CODE)`; an NCCL engine passes a function that aborts its communicators first).

`install_handlers()` adds dumps on SIGUSR1 and on an error exit. Python runs signal handlers only in the main thread
and only between bytecodes, never while it is blocked in a collective; so the handler's byte is taken from the
signal wakeup fd by the watchdog thread, which dumps at once, whatever the main thread is doing.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import get_args

from tandem.config import WatchdogAction
from tandem.distributed.flight_recorder import FATAL, STACKS, FlightRecorder

ABORT_EXIT_CODE = 70
ACTIONS = get_args(WatchdogAction)
_WAKE = b"\0"  # our own wake-up byte; 0 is no signal number


class Watchdog:
    """One per rank. `bump`, `pause`/`resume`/`idle` and `request_dump` may be called from any thread.
    `enabled=False` keeps signal-requested dumps but never fires on a stall."""

    def __init__(self, recorder: FlightRecorder, timeout_s: float, *, action: str = "wait",
                 poll_s: float | None = None, abort: Callable[[], None] | None = None, enabled: bool = True):
        if not timeout_s > 0:
            raise ValueError(f"watchdog: timeout_s must be > 0, got {timeout_s}")
        if action not in ACTIONS:
            raise ValueError(f"watchdog: action must be one of {ACTIONS}, got {action!r}")
        self.recorder, self.timeout_s, self.action, self.enabled = recorder, timeout_s, action, enabled
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 5)
        self._abort = abort or functools.partial(os._exit, ABORT_EXIT_CODE)
        self.progress, self.num_fired = 0, 0
        self._last_progress = time.monotonic()
        self._fired_for: float | None = None  # the _last_progress of the stall already reported
        self._num_paused, self._pause_lock = 0, threading.Lock()
        # (its own status is added at dump time: a bound method kept here would be a reference cycle, which holds
        # whatever the providers reach, an engine's KV pool among them, until the collector's next full pass)
        self._providers: dict[str, Callable[[], object]] = {}
        self._requests: list[str] = []
        self._dump_lock = threading.Lock()
        self._stop, self._thread = threading.Event(), None
        self._wake_r, self._wake_w = socket.socketpair()
        for end in (self._wake_r, self._wake_w):
            end.setblocking(False)
        self.dump_signals: set[int] = set()  # signals whose wakeup byte asks for a dump (install_handlers sets it)
        self.forward_fd = -1  # the wakeup fd we displaced (asyncio's): it still gets every signal byte
        self.last_dump: Path | None = None

    @property
    def wakeup_fileno(self) -> int:
        return self._wake_w.fileno()

    # --- what the engine loop calls --------------------------------------------------------------------------------
    def bump(self) -> None:
        self.progress += 1
        self._last_progress = time.monotonic()

    def pause(self) -> None:
        with self._pause_lock:
            self._num_paused += 1

    def resume(self) -> None:
        with self._pause_lock:
            assert self._num_paused > 0, "resume() without pause()"
            self._num_paused -= 1
            self._last_progress = time.monotonic()  # the idle time is not a stall

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def add_state(self, name: str, provider: Callable[[], object]) -> None:
        """`provider()` goes into every dump under `name` (JSON-able or tensors, which are dumped as metadata)."""
        self._providers[name] = provider

    def status(self) -> dict:
        stalled_s = time.monotonic() - self._last_progress
        return {"progress": self.progress, "last_progress_ns": time.time_ns() - int(stalled_s * 1e9),
                "stalled_s": round(stalled_s, 3), "paused": self._num_paused > 0, "timeout_s": self.timeout_s,
                "action": self.action, "enabled": self.enabled, "num_fired": self.num_fired}

    # --- dumps -----------------------------------------------------------------------------------------------------
    def dump(self, reason: str) -> Path | None:
        """Stacks, then providers and the recorder; returns the dump's path (None for a memory-only recorder)."""
        with self._dump_lock:
            stacks_file = None
            if self.recorder.dump_dir is not None:
                path = self.recorder.reserve_path(STACKS, "txt")
                with open(path, "w", encoding="utf-8") as f:
                    f.write(f"# {reason}\n")
                    f.flush()
                    faulthandler.dump_traceback(file=f, all_threads=True)
                stacks_file = path.name
            state = {}
            for name, provider in [("watchdog", self.status), *self._providers.items()]:
                try:
                    state[name] = provider()
                except Exception as e:  # one broken provider must not cost the rest of the evidence
                    state[name] = f"provider failed: {type(e).__name__}: {e}"
            self.last_dump = self.recorder.dump(reason, state, stacks_file)
            print(f"tandem watchdog: rank {self.recorder.rank}: {reason}; evidence: {self.last_dump}",
                  file=sys.stderr, flush=True)
            return self.last_dump

    def request_dump(self, reason: str) -> None:
        """Ask the watchdog thread to dump soon (safe from signal handlers and other threads)."""
        self._requests.append(reason)
        self._wake()

    @contextlib.contextmanager
    def dump_on_error(self) -> Iterator[None]:
        """Dump when the block raises, then re-raise: wrap a rank's main loop in it."""
        try:
            yield
        except Exception as e:
            self.dump(f"error exit: {type(e).__name__}: {e}")
            raise

    # --- the thread ------------------------------------------------------------------------------------------------
    def start(self) -> Watchdog:
        if self._thread is None:
            self._last_progress = time.monotonic()
            self._thread = threading.Thread(target=self._run, name=f"tandem-watchdog-{self.recorder.rank}",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5 + self.poll_s)
            self._thread = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(_WAKE)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._check()
            except Exception as e:  # a failed dump (full disk) must not end the watch
                print(f"tandem watchdog: rank {self.recorder.rank}: {type(e).__name__}: {e}", file=sys.stderr)

    def _check(self) -> None:
        self._wait_for_signals()
        while self._requests:
            self.dump(self._requests.pop(0))
        last = self._last_progress
        if not self.enabled or self._num_paused or self._fired_for == last:
            return
        stalled_s = time.monotonic() - last
        if stalled_s > self.timeout_s:
            self._fired_for, self.num_fired = last, self.num_fired + 1
            try:
                self.dump(f"watchdog: no progress for {stalled_s:.2f}s (timeout {self.timeout_s}s)")
            finally:
                if self.action == "abort":
                    self._abort()

    def _wait_for_signals(self) -> None:
        readable, _, _ = select.select([self._wake_r], [], [], self.poll_s)
        if not readable:
            return
        try:
            data = self._wake_r.recv(4096)
        except BlockingIOError:
            return
        signals = data.replace(_WAKE, b"")
        for signum in signals:
            if signum in self.dump_signals:
                self._requests.append(f"signal {signal.Signals(signum).name}")
        if signals and self.forward_fd >= 0:
            with contextlib.suppress(OSError):
                os.write(self.forward_fd, signals)


class Handlers:
    """What `install_handlers` changed; `uninstall()` puts it back."""

    def __init__(self):
        self.signals: dict[int, object] = {}
        self.wakeup_fd: int | None = None
        self.hooks: tuple | None = None
        self.fatal_file = None
        self.faulthandler_was_enabled = False

    def uninstall(self) -> None:
        for signum, previous in self.signals.items():
            signal.signal(signum, previous)
        if self.wakeup_fd is not None:
            signal.set_wakeup_fd(self.wakeup_fd)
        if self.hooks is not None:
            sys.excepthook, threading.excepthook = self.hooks
        if self.fatal_file is not None:
            faulthandler.disable()
            self.fatal_file.close()
            if self.faulthandler_was_enabled:
                faulthandler.enable(sys.__stderr__, all_threads=True)


def install_handlers(watchdog: Watchdog, *, signals: Iterable[int] = (signal.SIGUSR1,), wakeup: bool = True,
                     excepthook: bool = True, fatal: bool = True) -> Handlers:
    """Dump on `signals` (serviced by the watchdog thread through the signal wakeup fd, so also while the main
    thread is blocked in C++; `wakeup=False` leaves it to the Python handler, which runs only once the main thread
    is back in Python), on an uncaught exception in any thread (`excepthook`), and write faulthandler's stacks to
    `tandem_fatal.<boot>.rank<R>.txt` on a fatal signal (`fatal`). Call from the main thread, after any asyncio
    loop has added its signal handlers: the wakeup fd it displaces still receives every byte."""
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("install_handlers must be called from the main thread")
    handlers, signals = Handlers(), [int(s) for s in signals]
    for signum in signals:
        previous = signal.getsignal(signum)
        handlers.signals[signum] = previous
        signal.signal(signum, functools.partial(_on_signal, watchdog, previous, wakeup))
    if wakeup:
        handlers.wakeup_fd = signal.set_wakeup_fd(watchdog.wakeup_fileno, warn_on_full_buffer=False)
        watchdog.forward_fd, watchdog.dump_signals = handlers.wakeup_fd, set(signals)
    if excepthook:
        handlers.hooks = sys.excepthook, threading.excepthook
        previous_hook, previous_thread_hook = handlers.hooks

        def on_exception(exc_type, exc, tb):
            watchdog.dump(f"error exit: {exc_type.__name__}: {exc}")
            previous_hook(exc_type, exc, tb)

        def on_thread_exception(args):
            watchdog.dump(f"error in thread {args.thread.name if args.thread else '?'}: "
                          f"{args.exc_type.__name__}: {args.exc_value}")
            previous_thread_hook(args)

        sys.excepthook, threading.excepthook = on_exception, on_thread_exception
    if fatal and watchdog.recorder.dump_dir is not None:
        handlers.faulthandler_was_enabled = faulthandler.is_enabled()
        handlers.fatal_file = open(watchdog.recorder.path(FATAL, ext="txt"), "a", encoding="utf-8")  # noqa: SIM115
        faulthandler.enable(handlers.fatal_file, all_threads=True)
    return handlers


def _on_signal(watchdog: Watchdog, previous, wakeup: bool, signum: int, frame) -> None:
    if not wakeup:
        watchdog.request_dump(f"signal {signal.Signals(signum).name}")
    if callable(previous):
        previous(signum, frame)
