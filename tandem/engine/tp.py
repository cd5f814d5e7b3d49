"""Tensor-parallel engines: one process per rank, every rank running the same engine state machine.

Rank 0 owns the API. Every iteration of its loop is published to the other ranks before it runs: either a
state-changing command (a new request, an abort, a pause, a weight update...) or a step. Followers apply the
same sequence, so their schedulers hold the same requests in the same order. What could still make them
diverge is what each rank computes itself, and two protections close that:
  - the sampled-token broadcast (on by default): rank 0's sampled ids and logprobs replace every rank's
    before any host decision (finish, batch membership) reads them;
  - the lockstep sentinel: after every step the ranks all-gather a digest (step, membership, the step's
    chunks, the tokens just applied, finished count, host-tier state) and stop with an error naming the step,
    the ranks and the first differing field.
"""

from __future__ import annotations

import hashlib
import logging
import pickle

import torch

from tandem.distributed import collectives
from tandem.distributed.parallel import TPGroup

log = logging.getLogger(__name__)

DIGEST_FIELDS = ("step", "membership", "chunks", "tokens", "finished", "tier")


class LockstepError(RuntimeError):
    """Tensor-parallel ranks disagree about engine state: continuing would deadlock or diverge."""


def stable_hash(*parts) -> int:
    """A 56-bit hash that is the same in every process (Python's str hash is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=7).digest(), "little")


class Lockstep:
    """The control channel of a TP engine: rank 0 publishes messages, followers receive them, and all ranks
    compare digests. Uses `tp.cpu_group` (gloo), so it also works beside an NCCL data group."""

    def __init__(self, tp: TPGroup):
        self.tp = tp
        self.group = tp.cpu_group or tp.group
        self.last_digest: dict[str, int] = {}

    def publish(self, message) -> None:
        assert self.tp.rank == 0
        self._broadcast(pickle.dumps(message))

    def receive(self):
        return pickle.loads(self._broadcast(None))

    def _broadcast(self, payload: bytes | None) -> bytes:
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        collectives.broadcast(size, src=0, group=self.group)
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None
                else torch.empty(int(size), dtype=torch.uint8))
        collectives.broadcast(data, src=0, group=self.group)
        return data.numpy().tobytes()

    def check(self, digest: dict[str, int]) -> None:
        """All-gather every rank's digest; raise LockstepError naming the first field where a rank differs."""
        self.last_digest = digest
        mine = torch.tensor([digest[f] for f in DIGEST_FIELDS], dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.tp.size)]
        collectives.all_gather(rows, mine, group=self.group)
        for i, field in enumerate(DIGEST_FIELDS):
            ranks = [r for r in range(self.tp.size) if rows[r][i] != rows[0][i]]
            if ranks:
                raise LockstepError(f"lockstep: step {digest['step']}: rank(s) {ranks} differ from rank 0 in "
                                    f"{field!r} ({[int(row[i]) for row in rows]})")


def step_digest(engine, chunks) -> dict[str, int]:
    """What the sentinel compares after a step (`DIGEST_FIELDS`) of `engine`, whose step ran `chunks`."""
    return {
        "step": engine.stats.num_steps,
        "membership": stable_hash([r.rid for r in engine.scheduler.running]),
        "chunks": stable_hash([(c.req.rid, c.start, c.num_tokens) for c in chunks]),
        "tokens": engine._applied_digest,
        "finished": engine.stats.num_finished,
        "tier": stable_hash((engine.tier.num_free, engine.tier.in_flight)) if engine.tier else 0,
    }


def run_follower(engine) -> None:
    """The loop of a rank > 0: apply what rank 0 publishes until it publishes a stop, or until the ranks fall
    out of lockstep (every rank sees the same gathered digests, so all stop together)."""
    idle = False
    while not engine._stop:
        engine.watchdog.bump()
        if idle:  # rank 0 has nothing to do: waiting for its next message is no hang
            with engine.watchdog.idle():
                message = engine.lockstep.receive()
        else:
            message = engine.lockstep.receive()
        idle = message[0] == "idle"
        if message[0] == "stop":
            return
        if not idle:
            engine._apply(message)


def init_tp(rank: int, size: int, init_method: str, backend: str = "gloo") -> TPGroup:
    """Join the process group and make the TP groups: the model's collectives on `backend`, the control channel
    on gloo (every rank must call this in the same order)."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(minutes=30))
    data = dist.new_group(backend=backend, group_desc="tp")
    ctrl = dist.new_group(backend="gloo", group_desc="ctrl")
    return TPGroup(rank, size, data, ctrl)


def _follower_main(rank: int, size: int, init_method: str, backend: str, model, config, dtype, seed) -> None:
    from tandem.distributed.watchdog import install_handlers
    from tandem.engine.engine import Engine

    tp = init_tp(rank, size, init_method, backend)
    if config.device.startswith("cuda"):
        torch.cuda.set_device(rank)
    engine = Engine(model, config, dtype=dtype, seed=seed, tp=tp)
    install_handlers(engine.watchdog)  # SIGUSR1 dumps; so does an uncaught error
    with engine.watchdog.dump_on_error():
        run_follower(engine)
    engine.shutdown()


def start_followers(size: int, init_method: str, backend: str, model, config, dtype=None, seed: int = 0):
    """Spawn ranks 1..size-1 as processes running `run_follower`; the caller is rank 0."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_follower_main, args=(r, size, init_method, backend, model, config, dtype, seed),
                         name=f"tandem-tp-rank{r}", daemon=True) for r in range(1, size)]
    for p in procs:
        p.start()
    return procs
