"""The engine thread's host time by part of the prefix cache and the host tier: wall and thread CPU
seconds, and calls, of each outermost call of the methods in PARTS (a part called from inside another part counts
towards the outer one only). For `benchmarks/host_tier.py --parts`: where a run's scheduling time goes.

    with timed_parts() as parts:
        ...  # run an engine in this process
    print(parts.table())
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter

from tandem.engine.host_tier import HostTier
from tandem.engine.radix_cache import RadixCache

# (class, method): the prefix cache's tree work (a match: an admission's or a prefetch probe's; insert: with its
# backups' queueing and the host evictions they need), the tier's copies (before_compute: the loads; flush: the
# backups) and bookkeeping
PARTS = [(RadixCache, "match"), (RadixCache, "evict"), (RadixCache, "evict_host"), (RadixCache, "insert"),
         (RadixCache, "load"), (HostTier, "reap"), (HostTier, "before_compute"), (HostTier, "prefetch"),
         (HostTier, "flush"), (HostTier, "retire")]


class Parts:
    def __init__(self):
        self.wall, self.cpu, self.calls = Counter(), Counter(), Counter()
        self._depth = 0

    def table(self) -> str:
        """One line a part, most wall time first: wall s / CPU s (calls, us a call)."""
        return ", ".join(f"{k} {w:.3f} / {self.cpu[k]:.3f} ({self.calls[k]}, {w / self.calls[k] * 1e6:.0f} us)"
                         for k, w in self.wall.most_common())

    def as_dict(self) -> dict:
        return {k: {"wall_s": w, "cpu_s": self.cpu[k], "calls": self.calls[k]} for k, w in self.wall.items()}


def _timed(parts: Parts, name: str, method):
    def timed(*args, **kwargs):
        if parts._depth:
            return method(*args, **kwargs)
        parts._depth += 1
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            parts.wall[name] += time.perf_counter() - wall
            parts.cpu[name] += time.thread_time() - cpu
            parts.calls[name] += 1
            parts._depth -= 1
    return timed


@contextlib.contextmanager
def timed_parts():
    """Time the PARTS of every engine in this process (one engine thread at a time) while the block runs."""
    parts, saved = Parts(), [(cls, name, getattr(cls, name)) for cls, name in PARTS]
    for cls, name, method in saved:
        setattr(cls, name, _timed(parts, name.lstrip("_"), method))
    try:
        yield parts
    finally:
        for cls, name, method in saved:
            setattr(cls, name, method)
