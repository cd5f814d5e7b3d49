"""Keeping the garbage collector's full passes off what lives as long as a process (`freeze_heap`, `frozen_heap`).
Light on purpose (no torch, no HTTP client's packages): any benchmark may time under `frozen_heap`."""

from __future__ import annotations

import contextlib
import gc


def freeze_heap() -> None:
    """Leave what exists now (modules, models, the engine: built once, kept for the run) out of the garbage
    collector's later passes (`gc.freeze`). A full pass holds every thread of the process, an engine's too, while
    it scans every object (a run's imports and models among them), and no request advances meanwhile. Call once
    everything long-lived is built; `gc.unfreeze` when it goes. (No collection first: it would be such a pass
    itself; what is garbage now stays, once.)"""
    gc.freeze()


@contextlib.contextmanager
def frozen_heap():
    """`freeze_heap` for a while, in a process that builds engines one after another (a benchmark's
    configurations): collected first (a full pass, before the work that follows), let back at exit, so what was
    built within (an engine closed there) goes at a later pass (the next `frozen_heap`'s first), not never."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
