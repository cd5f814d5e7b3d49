"""Host time by part, as wall seconds and as the calling thread's CPU seconds.

The difference between the two is time the thread spent not running: blocked in a call, or waiting for the GIL
while another Python thread (the engine's clients, in one process) held it. A part whose wall time is much larger
than its CPU time is waiting, not working.
"""

from __future__ import annotations

import time


class HostClock:
    def __init__(self, parts: tuple[str, ...]):
        self.wall = dict.fromkeys(parts, 0.0)
        self.cpu = dict.fromkeys(parts, 0.0)

    @staticmethod
    def now() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def lap(self, part: str, since: tuple[float, float]) -> tuple[float, float]:
        """Count the time from `since` (a `now()`) to now towards `part`; returns now, where the next part starts."""
        now = time.perf_counter(), time.thread_time()
        self.wall[part] += now[0] - since[0]
        self.cpu[part] += now[1] - since[1]
        return now

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {part: {"wall_s": self.wall[part], "cpu_s": self.cpu[part]} for part in self.wall}
