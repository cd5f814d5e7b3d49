"""Tensor-parallel engines: one process per rank, every rank holding the same engine core.

Rank 0 runs the async facade (`tandem.engine.engine.Engine`), which publishes every command it applies; ranks
1..N-1 run `run_follower`, which applies the same commands to their own `EngineCore` in the same order. See
`tandem.engine.lockstep` for what keeps them in lockstep and what stops them when they are not.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing

import torch
import torch.distributed as dist

from tandem.distributed.parallel import TPGroup
from tandem.distributed.watchdog import Watchdog, install_handlers
from tandem.engine.commands import Idle, Stop
from tandem.engine.core import EngineCore, EngineError
from tandem.engine.engine import Engine, make_watchdog

log = logging.getLogger(__name__)


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


def init_tp(rank: int, size: int, init_method: str, backend: str = "gloo") -> TPGroup:
    """Join the process group and make the TP groups: the model's collectives on `backend`, the control channel
    on gloo (every rank must call this in the same order)."""
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(minutes=30))
    data = dist.new_group(backend=backend, group_desc="tp")
    ctrl = dist.new_group(backend="gloo", group_desc="ctrl")
    return TPGroup(rank, size, data, ctrl)


def _follower_main(rank: int, size: int, init_method: str, backend: str, model, config, dtype, seed) -> None:
    tp = init_tp(rank, size, init_method, backend)
    if config.device.startswith("cuda"):
        torch.cuda.set_device(rank)
    core = EngineCore(model, config, dtype=dtype, seed=seed, tp=tp)
    watchdog = make_watchdog(core)
    install_handlers(watchdog)  # SIGUSR1 dumps; so does an uncaught error
    with watchdog.dump_on_error():
        run_follower(core, watchdog)


def start_followers(size: int, init_method: str, backend: str, model, config, dtype=None, seed: int = 0):
    """Spawn ranks 1..size-1 as processes running `run_follower`; the caller is rank 0."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_follower_main, args=(r, size, init_method, backend, model, config, dtype, seed),
                         name=f"tandem-tp-rank{r}", daemon=True) for r in range(1, size)]
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
