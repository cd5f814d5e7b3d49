"""The control channel of a tensor-parallel engine, and the sentinel that proves its ranks stay in lockstep.

Rank 0 publishes every command it applies (`tandem.engine.commands`) before applying it; the other ranks receive
and apply the same sequence, so their schedulers hold the same requests in the same order. What could still make
them diverge is what each rank computes itself, and two protections close that:
  - the sampled-token broadcast (on by default, in the model runner): rank 0's sampled ids and logprobs replace
    every rank's before any host decision (finish, batch membership) reads them;
  - the lockstep sentinel (`Lockstep.check`): after every step the ranks all-gather a digest (`step_digest`) and
    stop with an error naming the step, the ranks and the first differing field. For a mixture-of-experts model
    it covers the routing: expert-parallel ranks route every token themselves and sum their experts' parts, so
    ranks that routed a token differently would mix two routings without any other sign.
"""

from __future__ import annotations

import hashlib
import pickle

import torch

from tandem.distributed import collectives
from tandem.distributed.parallel import TPGroup
from tandem.engine.commands import Command

DIGEST_FIELDS = ("step", "membership", "chunks", "tokens", "finished", "tier", "routing")


class LockstepError(RuntimeError):
    """Tensor-parallel ranks disagree about engine state: continuing would deadlock or diverge."""


def stable_hash(*parts) -> int:
    """A 56-bit hash that is the same in every process (Python's str hash is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=7).digest(), "little")


def step_digest(step: int, running_rids: list[str], chunks: list[tuple[str, int, int]], tokens: int, finished: int,
                tier: tuple[int, int] | None, routing: int = 0) -> dict[str, int]:
    """What the sentinel compares after a step (`DIGEST_FIELDS`): the step number, the running requests, the step's
    chunks as (rid, start, num_tokens), a hash of the tokens the step applied, the finished count, the host
    tier's (free pages, copies in flight), and a mixture-of-experts model's routing checksum after the applied
    step (`Qwen3ForCausalLM.keep_routing_checksum`; 0 for a dense model)."""
    return {"step": step, "membership": stable_hash(running_rids), "chunks": stable_hash(chunks), "tokens": tokens,
            "finished": finished, "tier": stable_hash(tier) if tier is not None else 0, "routing": routing}


class Lockstep:
    """Rank 0 publishes commands, followers receive them, and all ranks compare digests. Uses `tp.cpu_group`
    (gloo), so it also works beside an NCCL data group. Only `Command`s cross it, checked on both sides."""

    def __init__(self, tp: TPGroup):
        self.tp = tp
        self.group = tp.cpu_group or tp.group
        self.last_digest: dict[str, int] = {}

    def ready(self) -> None:
        """Wait until every rank has built its engine (so no rank's watchdog counts a slower rank's start)."""
        collectives.broadcast(torch.zeros(1, dtype=torch.int64), src=0, group=self.group)

    def publish(self, command: Command) -> None:
        assert self.tp.rank == 0 and isinstance(command, Command) and command.published, command
        self._broadcast(pickle.dumps(command))

    def receive(self) -> Command:
        command = pickle.loads(self._broadcast(None))
        if not isinstance(command, Command):
            raise LockstepError(f"lockstep: rank {self.tp.rank} received {type(command).__name__}, not a command")
        return command

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
