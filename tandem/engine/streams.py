"""The step placement (`tandem.engine.step_order`) applied: device work entered by name runs on the placement's
stream after the edges it names; a trace of what was entered, for the test that holds code and description
together; and the race guard, which counts changes to a graph replay's input buffers while the replay runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

from tandem.engine import step_order
from tandem.engine.step_order import DEVICE_STREAMS, Placement

# Test-only: run the engine on one of `step_order.mutants()` (the race guard's broken arm), never in production.
MUTANT_ENV = "TANDEM_TEST_PLACEMENT"


def engine_placements() -> tuple[Placement, ...]:
    """The engine's placements: `step_order.IN_USE`, or with a mutant in place of the decode step when the
    test-only `TANDEM_TEST_PLACEMENT` names one."""
    name = os.environ.get(MUTANT_ENV)
    if not name:
        return step_order.IN_USE
    mutants = step_order.mutants()
    if name not in mutants:
        raise ValueError(f"{MUTANT_ENV}: {name!r} is not one of {sorted(mutants)}")
    broken = {w.name: w for w in mutants[name][1].works}
    return tuple(dataclasses.replace(p, works=tuple(broken.get(w.name, w) for w in p.works))
                 for p in step_order.IN_USE)


class StreamRuntime:
    """Enters each named work on its stream. On CUDA the compute stream is the one current at construction (the
    engine thread's); the others are made on first use. A work waits, before it runs, for every edge its
    `after` names: a stream (everything issued there so far) or a work (the event recorded after the latest
    instance of it; recorded only for works some edge names). Host syncs are the caller's own waits (an event
    it holds): `note` only traces them. Elsewhere than CUDA it only traces."""

    def __init__(self, placements: tuple[Placement, ...], device: torch.device, trace: bool = False):
        self.works = {}
        for w in (w for p in placements for w in p.works):
            if self.works.setdefault(w.name, w) != w:
                raise ValueError(f"work {w.name!r} is described twice, differently: {self.works[w.name]} and {w}")
        self.cuda = device.type == "cuda"
        self.trace: list[str] | None = [] if trace else None
        self._waited = {a.partition("@")[0] for w in self.works.values() if w.stream != "host"
                        for a in w.after if a not in DEVICE_STREAMS}
        self._events: dict[str, torch.cuda.Event] = {}
        self._streams = {"compute": torch.cuda.current_stream(device)} if self.cuda else {}
        self._device = device

    def _work(self, name: str):
        work = self.works.get(name)
        if work is None:
            raise KeyError(f"work {name!r} is not in the engine's placement (tandem.engine.step_order names "
                           f"{sorted(self.works)}): describe it there first")
        if self.trace is not None:
            self.trace.append(name)
        return work

    def note(self, name: str) -> None:
        """A host-side wait the caller does itself (traced, checked to be described)."""
        self._work(name)

    def stream(self, role: str) -> torch.cuda.Stream:
        if role not in self._streams:
            self._streams[role] = torch.cuda.Stream(self._device)
        return self._streams[role]

    @contextlib.contextmanager
    def work(self, name: str):
        """Run the body as work `name`: on its stream, after its edges."""
        work = self._work(name)
        if not self.cuda or work.stream == "host":
            yield
            return
        stream = self.stream(work.stream)
        for edge in work.after:
            if edge in DEVICE_STREAMS:
                stream.wait_stream(self.stream(edge))
            elif (event := self._events.get(edge.partition("@")[0])) is not None:
                stream.wait_event(event)
        if stream is self._streams["compute"]:
            yield
        else:
            with torch.cuda.stream(stream):
                yield
        if name in self._waited:
            event = self._events[name] = torch.cuda.Event()
            event.record(stream)


class RaceGuard:
    """Counts, on the device and with no host sync, the elements of a graph replay's input buffers that change
    while the replay runs: `before` snapshots them and `after` compares, both on the stream of the replay. A
    placement that orders every write to those buffers around the replay reads 0 (`count`, which syncs)."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = buffers
        self.snapshots = [torch.empty_like(b) for b in buffers]
        self.changed = torch.zeros((), dtype=torch.int64, device=buffers[0].device)
        self.replays = 0

    def before(self) -> None:
        for snapshot, buffer in zip(self.snapshots, self.buffers, strict=True):
            snapshot.copy_(buffer)

    def after(self) -> None:
        self.replays += 1
        for snapshot, buffer in zip(self.snapshots, self.buffers, strict=True):
            self.changed += (snapshot != buffer).sum()

    def count(self) -> int:
        return int(self.changed)
