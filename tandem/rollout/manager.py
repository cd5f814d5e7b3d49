"""The rollout manager: keeps episodes in flight on the engine and hands the trainer batches of groups.

Admission (AReaL's rule): groups are numbered in admission order and batch s is exactly groups
s*B .. (s+1)*B - 1, trained with the weights of version s. A group admitted while the engine holds version
v is therefore trained at most `max_staleness` versions later iff its number is below
(max_staleness + v + 1) * B; the manager admits a group only then, and only when `num_in_flight` has room
for all its episodes. Every free slot is filled at once; nothing sleeps on a timer; everything runs on the
caller's event loop and nothing in it blocks.

Accounting: every group admitted is, at any time, in flight, completed and buffered, handed to the trainer
(once: a batch is popped from the buffer), or dropped with its reason counted in `dropped`. Completed
groups beyond the current batch stay buffered for the next ones.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

from tandem.config import RolloutConfig
from tandem.rollout.agent import GenerateClient, run_episode
from tandem.rollout.env import EnvFactory
from tandem.types import Episode, Group

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _InFlight:
    index: int
    start_version: int
    episodes: list[Episode]
    remaining: int
    failure: str | None = None


class RolloutManager:
    def __init__(self, client: GenerateClient, make_env: EnvFactory, cfg: RolloutConfig, max_context: int,
                 seed: int, version: Callable[[], int]):
        self.client, self.make_env, self.cfg = client, make_env, cfg
        self.max_context, self.seed, self.version = max_context, seed, version
        self.next_index = 0  # number of the next group to admit
        self.batches_taken = 0  # batches handed to the trainer
        self.buffer: dict[int, Group] = {}  # completed groups not yet handed out
        self.in_flight: dict[int, _InFlight] = {}
        self.dropped: Counter[str] = Counter()  # reason -> groups
        self._dropped_indices: set[int] = set()
        self._readmit: list[int] = []  # numbers of groups to run again (in flight when a checkpoint was taken)
        self.num_in_flight_episodes = 0
        self._tasks: set[asyncio.Task] = set()
        self._admit_wake = asyncio.Event()
        self._batch_wake = asyncio.Event()

    # ---- admission ---------------------------------------------------------------------------------------
    @property
    def admission_limit(self) -> int:
        """Groups that may have been admitted, in total, while the engine holds its current version."""
        return (self.cfg.max_staleness + self.version() + 1) * self.cfg.batch_groups

    def _has_room(self) -> bool:
        return self.num_in_flight_episodes + self.cfg.group_size <= self.cfg.num_in_flight

    def fill(self) -> None:
        """Admit every group the slots and the staleness bound allow, right now."""
        while self._readmit and self._has_room():
            self._start(self._readmit.pop(0))
        while not self._readmit and self._has_room() and self.next_index < self.admission_limit:
            self._start(self.next_index)
            self.next_index += 1

    async def run(self) -> None:
        """Keep admitting until cancelled. Wakes on every completion and every version change."""
        while True:
            self.fill()
            await self._admit_wake.wait()
            self._admit_wake.clear()

    def notify_version(self) -> None:
        """Call after the engine's weight version changed: the staleness bound may admit more."""
        self._admit_wake.set()

    def _start(self, index: int) -> None:
        version = self.version()
        group_seed = random.Random(f"{self.seed}-group-{index}").getrandbits(63)
        group = _InFlight(index, version, [], self.cfg.group_size)
        self.in_flight[index] = group
        for j in range(self.cfg.group_size):
            episode = Episode(episode_id=f"g{index}-{j}", group_id=index, start_version=version)
            group.episodes.append(episode)
            env = self.make_env(group_seed, j)
            task = asyncio.create_task(run_episode(self.client, env, episode, self.max_context,
                                                   self.cfg.temperature, self.cfg.top_p))
            self._tasks.add(task)
            task.add_done_callback(lambda t, g=group: self._episode_done(g, t))
        self.num_in_flight_episodes += self.cfg.group_size

    def _episode_done(self, group: _InFlight, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return  # shutdown: the group stays in `in_flight` and is re-run from a checkpoint
        self.num_in_flight_episodes -= 1
        exc = task.exception()
        if exc is not None:
            log.warning("episode of group %d failed: %r", group.index, exc)
            group.failure = group.failure or f"{type(exc).__name__}: {exc}"
        group.remaining -= 1
        if group.remaining == 0:
            del self.in_flight[group.index]
            if group.failure is not None:
                self.dropped[group.failure] += 1
                self._dropped_indices.add(group.index)
            else:
                self.buffer[group.index] = Group(group.index, group.episodes, group.start_version)
            self._batch_wake.set()
        self._admit_wake.set()

    # ---- the trainer's side ------------------------------------------------------------------------------
    def batch_ready(self) -> bool:
        return all(i in self.buffer or i in self._dropped_indices for i in self._window())

    def _window(self) -> range:
        B = self.cfg.batch_groups
        return range(self.batches_taken * B, (self.batches_taken + 1) * B)

    async def next_batch(self) -> list[Group]:
        """The next batch: groups s*B .. (s+1)*B - 1 (dropped ones left out), waiting for stragglers."""
        while not self.batch_ready():
            self._batch_wake.clear()
            await self._batch_wake.wait()
        batch = [self.buffer.pop(i) for i in self._window() if i in self.buffer]
        self.batches_taken += 1
        return batch

    # ---- shutdown and checkpoints ------------------------------------------------------------------------
    async def stop(self) -> None:
        """Cancel the episodes in flight. Their groups stay recorded as in flight: `state_dict` lists them
        for re-running, so nothing admitted is lost across a checkpoint."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def state_dict(self) -> dict:
        return {
            "next_index": self.next_index,
            "batches_taken": self.batches_taken,
            "buffer": {i: asdict(g) for i, g in self.buffer.items()},
            "rerun": sorted(set(self.in_flight) | set(self._readmit)),
            "dropped": dict(self.dropped),
            "dropped_indices": sorted(self._dropped_indices),
        }

    def load_state_dict(self, state: dict) -> None:
        self.next_index, self.batches_taken = state["next_index"], state["batches_taken"]
        self.buffer = {int(i): Group(g["index"], [Episode(**e) for e in g["episodes"]], g["start_version"])
                       for i, g in state["buffer"].items()}
        self._readmit = list(state["rerun"])
        self.dropped = Counter(state["dropped"])
        self._dropped_indices = set(state["dropped_indices"])

    def summary(self) -> dict:
        return {"in_flight_episodes": self.num_in_flight_episodes, "buffered_groups": len(self.buffer),
                "admitted_groups": self.next_index, "dropped_groups": sum(self.dropped.values())}
