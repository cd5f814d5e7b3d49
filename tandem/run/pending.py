"""A weight push the engine may not have applied yet (`PendingSync`), and one sync's figures (`SyncStats`).

On one GPU the engine reads the trainer's own tensors (by reference). A push then only has to put the load in the
engine's queue: the engine applies it at its next step boundary, while the trainer goes on (its next step's
forward and backward only read the weights). Three orderings keep that sound:
- the engine's reads come after the trainer's last writes: the transfer's `ready` event (the device), and the
  load's place in the engine's queue ahead of every later request (the host: no token of a request submitted after
  the push is sampled with the older weights);
- the trainer's next writes come after the engine's reads: before writing (the optimizer step, or the refresh of
  the compute copy) the trainer calls `fence`, which waits on the host until the engine has enqueued its copy
  (normally long done: the trainer's forward and backward ran meanwhile), closes the transfer (no read may start
  after it), and makes the caller's current stream wait for the copy's `done` event (the device, no host sync);
- the rollout manager counts a version as in force only once the engine applied it: it reads the engine's own
  `weight_version`, which the load sets, and the run tells it of the change when `applied` returns.
Pushes apply one at a time and in order: a push first settles the previous one (its load applied, or its error
raised). A load that fails raises its error from `fence` and `applied` (the trainer's next write, or the run's
next step), never silently.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.transport.sync import SyncReply
from tandem.transport.weights import TransferStats, TransportError


@dataclass(frozen=True, slots=True)
class SyncStats:
    """One weight sync, `sync_s` as the trainer waited for it: its own send (`sent`) and the engine's reply
    (`reply`). `transfer_s`: the send, until the engine holds the weights (it keeps generating meanwhile), of it
    `wait_s` until the engine started receiving, where the transport can tell; `pause_s`: generation excluded (pause,
    load into the parameters, resume). `applied_s`: for a push that returned before the engine applied it (a
    `PendingSync`), from its start until the engine's reply was seen; None when the push returned only then."""

    sent: TransferStats
    reply: SyncReply
    sync_s: float
    applied_s: float | None = None

    @property
    def transfer_s(self) -> float:
        return self.sent.seconds

    @property
    def wait_s(self) -> float:
        return self.sent.wait_s

    @property
    def pause_s(self) -> float:
        return self.reply.pause_s

    @property
    def num_bytes(self) -> int:
        return self.sent.num_bytes

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0


class PendingSync:
    """One push of weights `version`, its load queued to the engine. `sent`: the trainer's side (its `seconds`:
    what the push made the trainer wait); `reply`: a future (of any thread) of the engine's `SyncReply` once it
    applied the load, or its error. `close`: called once, by `fence` or `abandon`, with whether to order the
    caller's stream after the engine's reads (False: only refuse reads that have not started). `what`: names the
    engine in errors."""

    def __init__(self, version: int, sent: TransferStats, reply: concurrent.futures.Future,
                 close: Callable[[bool], None], timeout_s: float, what: str = "the engine",
                 stats: SyncStats | None = None):
        self.version, self.sent, self.reply, self._stats = version, sent, reply, stats
        self.timeout_s, self.what = timeout_s, what
        self._close = close
        self._lock = threading.Lock()
        self._closed = False
        self._error: BaseException | None = None
        t0, self._applied_at = time.perf_counter() - sent.seconds, []
        # (a closure over the list, not a bound method: the future keeps its callbacks, and a cycle through this
        # object would keep the tensors it hands over alive until the collector's next full pass)
        reply.add_done_callback(lambda _, at=self._applied_at: at.append(time.perf_counter() - t0))

    @classmethod
    def completed(cls, stats: SyncStats) -> PendingSync:
        """A push that returned only once the engine held the weights: nothing left to wait for or to order."""
        reply: concurrent.futures.Future = concurrent.futures.Future()
        reply.set_result(stats.reply)
        return cls(stats.reply.weight_version, stats.sent, reply, lambda _: None, 1.0, stats=stats)

    def done(self) -> bool:
        """Whether the engine's load has ended (applied or failed)."""
        return self.reply.done()

    async def applied(self) -> SyncStats:
        """Wait (without blocking the event loop, at most `timeout_s`) until the engine applied the load; its
        figures. Raises the load's error, or TransportError naming the engine when it did not load in time (the
        transfer is then closed: a late load reads nothing)."""
        if self._stats is not None:
            return self._stats
        try:  # (not `wait_for`: on Python 3.11 it swallows a cancel that comes as the reply does, and Ctrl-C with it)
            async with asyncio.timeout(self.timeout_s):
                reply = await asyncio.shield(asyncio.wrap_future(self.reply))
        except TimeoutError:
            self.abandon()
            raise self._late() from None
        return SyncStats(self.sent, reply, self.sent.seconds, self._applied_at[0] if self._applied_at else None)

    def fence(self) -> None:
        """Before the trainer writes the pushed tensors again (from any thread): wait on the host until the engine
        has enqueued its reads (at most `timeout_s`), close the transfer to later reads, and make the caller's
        current stream wait for the reads on the device. Raises the load's error, or TransportError when the
        engine did not take the load in time (then no read of it ever happens). Idempotent: later calls return at
        once, or raise the same error."""
        with self._lock:
            if not self._closed:
                self._closed = True
                try:
                    self.reply.result(self.timeout_s)
                except concurrent.futures.TimeoutError:
                    self._error = self._late()
                except BaseException as e:  # the load's own error (the engine refused the weights, or stopped)
                    self._error = e
                try:
                    self._close(True)
                except BaseException as e:  # (closing failed: an acknowledgement missing) raised now and later
                    self._error = self._error or e
        if self._error is not None:
            raise self._error

    def abandon(self) -> None:
        """Close the transfer without waiting (shutdown, a failed or timed out push): a load that has not started
        reading is refused (in this process; another process's is not, but the transport refuses further
        transfers); one reading finishes enqueuing first. A load still pending is not waited for on the device
        either: later `fence` calls raise. Never raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self.reply.done():  # (applied or failed: nothing left to refuse, and ordering costs nothing)
                    self._error = self.reply.exception()
                    self._close(True)
                else:
                    self._error = self._late()
                    self._close(False)
            except BaseException as e:
                self._error = self._error or e

    def _late(self) -> TransportError:
        return TransportError(f"weights: {self.what} did not load weights version {self.version} within "
                              f"timeout_s={self.timeout_s:g}", ranks=(1,))
