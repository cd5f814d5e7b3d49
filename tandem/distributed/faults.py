"""Fault injection for the hang and divergence tests. Off unless configured; importable without torch.

One `FaultPlan` per process, set with `configure(plan)` or read from the environment variable `TANDEM_FAULTS`,
a comma-separated list of `field=value`, e.g. `TANDEM_FAULTS="rank=1,action=skip,seq=5,group=tp"`.

Collective faults act once, in the recorded collectives of `collectives`, when this rank is about to issue
the collective with `collective_seq_id == seq` on `group` (a process group's name or description; empty: any):
- `skip`: the call is not issued and not recorded, as if this rank's code had taken another branch. On one group of
  identical calls gloo then pairs the rank's next call with the skipped one and nothing hangs; the hang comes where
  the calls differ (another group, another op), which is where a diverged rank really gets stuck.
- `delay`: sleep `delay_s`, then issue it.
- `exit`: `os._exit(exit_code)` without cleanup, like a crash (the journal on disk is already flushed).

Token flips are for the engine: `should_flip(step, rank)` is a deterministic draw with probability `flip_prob`,
seeded by `flip_seed`, true only on `flip_rank`.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass, fields

ENV_VAR = "TANDEM_FAULTS"
ACTIONS = ("none", "skip", "delay", "exit")


@dataclass(frozen=True)
class FaultPlan:
    rank: int = -1  # the rank that misbehaves at a collective; -1: none
    action: str = "none"
    seq: int = 0  # the collective_seq_id to act on
    group: str = ""  # process group name or description; empty: any group
    delay_s: float = 0.0
    exit_code: int = 1
    flip_rank: int = -1  # the rank whose sampled tokens flip; -1: none
    flip_prob: float = 0.0
    flip_seed: int = 0

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"faults: action must be one of {ACTIONS}, got {self.action!r}")
        if self.seq < 0:
            raise ValueError(f"faults: seq must be >= 0, got {self.seq}")
        if self.delay_s < 0:
            raise ValueError(f"faults: delay_s must be >= 0, got {self.delay_s}")
        if not 0.0 <= self.flip_prob <= 1.0:
            raise ValueError(f"faults: flip_prob must be in [0, 1], got {self.flip_prob}")

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """`"rank=1,action=skip,seq=5"` -> FaultPlan. Unknown fields and bad values raise ValueError naming them."""
        types = {f.name: f.type for f in fields(cls)}
        kwargs: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep or name not in types:
                raise ValueError(f"faults: unknown field {name!r} in {ENV_VAR}={text!r}; fields: {sorted(types)}")
            convert = {"int": int, "float": float}.get(types[name], str)
            try:
                kwargs[name] = convert(value.strip())
            except ValueError:
                raise ValueError(f"faults: {name} must be {types[name]}, got {value!r}") from None
        return cls(**kwargs)

    @classmethod
    def from_env(cls, environ=None) -> FaultPlan:
        return cls.parse((os.environ if environ is None else environ).get(ENV_VAR, ""))

    @property
    def active(self) -> bool:
        return self.action != "none" and self.rank >= 0


_lock = threading.Lock()
_plan: FaultPlan | None = None  # None: not yet read from the environment
_fired = False


def configure(plan: FaultPlan | None) -> None:
    """Install `plan` for this process (None: read `TANDEM_FAULTS` again on next use) and re-arm it."""
    global _plan, _fired
    with _lock:
        _plan, _fired = plan, False


def current() -> FaultPlan:
    global _plan
    with _lock:
        if _plan is None:
            _plan = FaultPlan.from_env()
        return _plan


def before_collective(rank: int, group_names: tuple[str, ...], seq: int) -> bool:
    """Called before this rank issues collective `seq` on a group known by `group_names`. Sleeps or exits as the
    plan says; returns True when the call must be skipped. Each plan acts at most once per process."""
    global _fired
    plan = current()
    if not plan.active or _fired or rank != plan.rank or seq != plan.seq:
        return False
    if plan.group and plan.group not in group_names:
        return False
    with _lock:
        if _fired:
            return False
        _fired = True
    if plan.action == "delay":
        time.sleep(plan.delay_s)
    elif plan.action == "exit":
        os._exit(plan.exit_code)
    return plan.action == "skip"


def should_flip(step: int, rank: int, plan: FaultPlan | None = None) -> bool:
    """True when the engine should flip rank `rank`'s sampled token at `step`: probability `flip_prob` on
    `flip_rank` only, the same answer for the same (seed, step, rank) on every run and every machine."""
    plan = current() if plan is None else plan
    if rank != plan.flip_rank or plan.flip_prob <= 0.0:
        return False
    digest = hashlib.blake2b(f"{plan.flip_seed}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < plan.flip_prob
