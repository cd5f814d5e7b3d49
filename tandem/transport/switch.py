"""The interpreter's thread switch interval, shortened while a weight transfer runs (`switching`)."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

SWITCH_S = 2e-4  # seconds, while any transfer of the process runs (below the interpreter's default)


class Switching:
    """`with switching():` keeps the process's thread switch interval at `SWITCH_S` while any transfer of the
    process runs (transfers may overlap: both ends in one process, several groups), then restores it. A transfer's
    threads wake several times (a hello, each bucket's metadata, the landing, the acknowledgements, the engine's
    reply), and each time they need the GIL, which another thread may hold: an engine's while it builds steps, a
    trainer's event loop while it runs the agents; each wake-up may wait up to the switch interval for it."""

    def __init__(self):
        self.lock, self.users, self.saved = threading.Lock(), 0, 0.0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self.lock:
            if not self.users:
                self.saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self.saved, SWITCH_S))
            self.users += 1
        try:
            yield
        finally:
            with self.lock:
                self.users -= 1
                if not self.users:
                    sys.setswitchinterval(self.saved)


switching = Switching()
