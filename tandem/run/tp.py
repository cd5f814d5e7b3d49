"""Tensor- and expert-parallel engines: one process per rank, every rank holding the same engine core.

Rank 0 runs the async facade (`tandem.engine.engine.Engine`), which publishes every command it applies; ranks
1..N-1 run `run_follower`, which applies the same commands to their own `EngineCore` in the same order. See
`tandem.engine.lockstep` for what keeps them in lockstep and what stops them when they are not.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import multiprocessing
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from tandem.distributed.parallel import TPGroup
from tandem.distributed.watchdog import Watchdog, install_handlers
from tandem.engine.commands import Idle, Stop
from tandem.engine.core import EngineCore, EngineError
from tandem.engine.engine import Engine, make_watchdog
from tandem.transport.dist import rendezvous

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1  # prctl(2)


def run_follower(core: EngineCore, watchdog: Watchdog | None = None) -> None:
    """The loop of a rank > 0: apply what rank 0 publishes until it publishes `Stop`, or until the ranks fall out
    of lockstep (every rank sees the same gathered digests, so all stop together). A command rank 0's caller made
    a mistake in is refused here too, the same way; rank 0 reports it. `watchdog`: the loop's (one of
    `make_watchdog(core)` by default)."""
    watchdog = watchdog or make_watchdog(core)
    watchdog.start()
    idle = False
    try:
        while core.fatal is None:
            watchdog.bump()
            if idle:  # rank 0 has nothing to do: waiting for its next command is no hang
                with watchdog.idle():
                    command = core.lockstep.receive()
            else:
                command = core.lockstep.receive()
            if isinstance(command, Stop):
                return
            idle = isinstance(command, Idle)
            with contextlib.suppress(ValueError, EngineError):
                core.apply(command)
            core.take_finished()  # (rank 0 answers the callers)
        watchdog.dump(str(core.fatal))
    finally:
        watchdog.stop()


JOIN_TIMEOUT = datetime.timedelta(minutes=30)


def init_tp(rank: int, size: int, init_method: str | dist.Store, backend: str = "gloo", ep: int = 1) -> TPGroup:
    """Join the process group of `size` ranks and make the engine's groups: the model's collectives on `backend`,
    the control channel on gloo. `init_method`: a URL, or the ranks' store (`rendezvous_store` and the followers'
    clients of it, as `start_followers` makes them). `ep` > 1: expert parallelism over a grid of tp = size / ep by
    ep ranks (rank r is dense rank r % tp of dense group r // tp, expert rank r // tp of expert group r % tp; see
    `TPGroup`). Every rank must call this with the same arguments (one kind of `init_method`)."""
    _check_grid(size, ep)
    where = {"store": init_method} if isinstance(init_method, dist.Store) else {"init_method": init_method}
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=JOIN_TIMEOUT, **where)
    data = dist.new_group(backend=backend, group_desc="tp")
    ctrl = dist.new_group(backend="gloo", group_desc="ctrl")
    if ep == 1:
        return TPGroup(rank, size, data, ctrl)
    tp = size // ep
    # every rank makes every group, in the same order (torch.distributed requires it), and keeps its own
    dense = [dist.new_group([e * tp + i for i in range(tp)], backend=backend, group_desc="tp_dense")
             for e in range(ep)] if tp > 1 else None
    experts = [dist.new_group([e * tp + i for e in range(ep)], backend=backend, group_desc="ep") for i in range(tp)]
    return TPGroup(rank, size, data, ctrl,
                   dense=TPGroup(rank % tp, tp, dense[rank // tp]) if dense else TPGroup(),
                   experts=TPGroup(rank // tp, ep, experts[rank % tp], kind="expert"))


def _check_grid(size: int, ep: int) -> None:
    if ep < 1 or size % ep:
        raise ValueError(f"expert parallelism: ep ({ep}) must divide the number of ranks ({size})")


def rendezvous_store(host: str = "127.0.0.1") -> dist.TCPStore:
    """Rank 0's store for `init_tp` and `start_followers`: listening from here on, on a port the system chose
    (`.port`), so no other process can take it between its choice and its use."""
    return rendezvous(host, JOIN_TIMEOUT.total_seconds())


def _die_with_parent(parent: int) -> None:
    """Have the system kill this process when its parent dies (Linux), however the parent ends: a follower whose
    rank 0 is gone has nothing to do, and would otherwise wait for it (up to `JOIN_TIMEOUT` in the rendezvous)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def _follower_main(rank: int, size: int, store_address: tuple[str, int], backend: str, model, config, dtype, seed,
                   ep: int, parent: int) -> None:
    _die_with_parent(parent)
    host, port = store_address
    store = dist.TCPStore(host, port, size, is_master=False, timeout=JOIN_TIMEOUT)
    _check_grid(size, ep)  # (init_tp's first check: before this rank says it is about to join)
    store.set(_arrived(rank), "1")
    tp = init_tp(rank, size, store, backend, ep)
    if config.device.startswith("cuda"):
        torch.cuda.set_device(rank)
    core = EngineCore(model, config, dtype=dtype, seed=seed, tp=tp)
    watchdog = make_watchdog(core)
    install_handlers(watchdog)  # SIGUSR1 dumps; so does an uncaught error
    with watchdog.dump_on_error():
        run_follower(core, watchdog)


def _arrived(rank: int) -> str:
    return f"tandem/follower{rank}/arrived"


def await_followers(store: dist.Store, procs, timeout_s: float = JOIN_TIMEOUT.total_seconds(),
                    poll_s: float = 0.1) -> None:
    """Rank 0, before `init_tp`: wait until every follower `start_followers` started is about to join, and raise
    RuntimeError naming the first one that ended before that (its exit code), or TimeoutError after `timeout_s`, where
    joining would wait for it the whole `JOIN_TIMEOUT`."""
    deadline = time.monotonic() + timeout_s
    for rank, p in enumerate(procs, 1):
        while not store.check([_arrived(rank)]):
            if p.exitcode is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode} before "
                                   "joining; its error is in the log above")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel rank {rank} (pid {p.pid}) did not come to join in "
                                   f"{timeout_s:.0f} s")
            time.sleep(poll_s)


def start_followers(size: int, store: dist.TCPStore, backend: str, model, config, dtype=None, seed: int = 0,
                    ep: int = 1):
    """Spawn ranks 1..size-1 as processes running `run_follower`, each joining through `store` (rank 0's,
    `rendezvous_store`); the caller is rank 0 (`init_tp(0, size, store, ...)` with the same size and `ep`). The
    followers die with the thread that starts them (on Linux; start them from the main thread): none outlives a
    rank 0 that crashed or was killed. Then `await_followers`, which notices one that ends before joining."""
    ctx = multiprocessing.get_context("spawn")
    address = (store.host, store.port)
    procs = [ctx.Process(target=_follower_main, name=f"tandem-tp-rank{r}", daemon=True,
                         args=(r, size, address, backend, model, config, dtype, seed, ep, os.getpid()))
             for r in range(1, size)]
    for p in procs:
        p.start()
    return procs


def engine_or_follow(model, config, tp: TPGroup, dtype: str | None = None, seed: int = 0) -> Engine | None:
    """On rank 0 the engine's facade, for the caller to drive; on other ranks follow rank 0 until it stops, then
    return None."""
    if tp.rank == 0:
        return Engine(model, config, dtype=dtype, seed=seed, tp=tp)
    run_follower(EngineCore(model, config, dtype=dtype, seed=seed, tp=tp))
    return None
