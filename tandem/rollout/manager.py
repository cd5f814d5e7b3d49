"""The rollout manager: keeps episodes in flight on the engine and hands the trainer batches of groups.

Admission (AReaL's rule): batch s is trained with the weights of version s and holds B groups. A group
admitted while the engine holds version v must be trained by batch v + max_staleness, its deadline; the
manager admits a group only while fewer than (max_staleness + v + 1) * B have been admitted in all, and only
when `num_in_flight` has room for all its episodes. Every free slot is filled at once; nothing sleeps on a
timer; everything runs on the caller's event loop and nothing in it blocks.

Batches (`batch_order`): "admission" makes batch s exactly groups s*B .. (s+1)*B - 1, so one long episode holds
its whole batch back and, through the bound, admission too. "deadline" (the default) fills batch s with the
finished groups of earliest deadline: short groups overtake a long one until its deadline, which keeps the
engine full. A batch may take a group due later only if every unfinished group still fits into the batches up
to its own deadline (`plan_batch`); with that rule and the admission rule no group misses its deadline. Both
orders give the same batches at max_staleness 0 (synchronous RL). The cost of "deadline": within the bound,
short episodes are trained earlier than long ones.

Accounting: every group admitted is, at any time, in flight, completed and buffered, handed to the trainer
(once: a batch is popped from the buffer), or dropped with its reason counted in `dropped`. Completed
groups beyond the current batch stay buffered for the next ones. A group whose episode failed because the engine
could not be reached (`EngineUnreachable`: its process died or hangs) is not the group's fault: it is run again
(from a checkpoint, if the run stops), and dropped only after `ENGINE_RETRIES` such failures. With engine replicas
the re-run goes to another replica (`retry_delay_s` 0: at once); `rerun_groups` counts them. A group with a token
sampled under weights older than its episode's start version (only a replica that got traffic before it held the
current weights could sample one) is dropped with that reason: it would break the staleness bound.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

from tandem.config import RolloutConfig
from tandem.engine.client import EngineUnreachable
from tandem.rollout.agent import GenerateClient, run_episode
from tandem.rollout.env import EnvFactory
from tandem.types import Episode, Group

log = logging.getLogger(__name__)

ENGINE_RETRIES = 3  # runs of a group that the engine's unreachability may cut short before it is dropped
RETRY_DELAY_S = 2.0  # before the first re-run; doubled each time


@dataclass(slots=True)
class _InFlight:
    index: int
    start_version: int
    episodes: list[Episode]
    remaining: int
    failure: str | None = None
    engine_gone: str | None = None  # an episode failed only because the engine could not be reached: why


def plan_batch(batch: int, size: int, max_staleness: int, order: Literal["admission", "deadline"],
               unconsumed: dict[int, int], done: set[int]) -> list[int] | None:
    """The `size` groups of batch `batch`, or None while it must wait. `unconsumed`: number -> start version of
    every admitted group not yet in a batch (running, finished or dropped); `done`: those finished or dropped.
    Group i is due by batch unconsumed[i] + max_staleness."""
    if order == "admission":
        pick = sorted(unconsumed)[:size]
        return pick if len(pick) == size and all(i in done for i in pick) else None
    pick = sorted(done, key=lambda i: (unconsumed[i], i))[:size]  # earliest deadline first
    if len(pick) < size:
        return None
    # for every deadline d, the groups due by d that this batch leaves must fit in the batches after it up to d
    due = sorted(unconsumed[i] + max_staleness for i in unconsumed)
    taken = sorted(unconsumed[i] + max_staleness for i in pick)
    for d in set(due):
        left = sum(e <= d for e in due) - sum(e <= d for e in taken)
        if left > (d - batch) * size:
            return None
    return pick


class RolloutManager:
    """`routing`: every episode keeps the engine's routed experts (`run_episode`), for a trainer of a
    mixture-of-experts model (routing replay and its metrics); the engine must keep them."""

    def __init__(self, client: GenerateClient, make_env: EnvFactory, cfg: RolloutConfig, max_context: int,
                 seed: int, version: Callable[[], int], routing: bool = False, retry_delay_s: float | None = None):
        self.client, self.make_env, self.cfg, self.routing = client, make_env, cfg, routing
        self.retry_delay_s = retry_delay_s
        self.rerun_groups = 0  # groups run again because the engine (a replica) could not be reached
        self.max_context, self.seed, self.version = max_context, seed, version
        self.next_index = 0  # number of the next group to admit
        self.batches_taken = 0  # batches handed to the trainer
        self.buffer: dict[int, Group] = {}  # completed groups not yet handed out
        self.in_flight: dict[int, _InFlight] = {}
        self.dropped: Counter[str] = Counter()  # reason -> groups
        self._dropped_indices: set[int] = set()
        self._dropped_pending: dict[int, int] = {}  # dropped groups not yet counted in a batch -> start version
        self._readmit: list[int] = []  # numbers of groups to run again (in flight when a checkpoint was taken)
        self._engine_failures: Counter[int] = Counter()  # group -> runs cut short by an unreachable engine
        self._retrying: set[int] = set()  # such groups waiting out their back-off
        self._timers: list[asyncio.TimerHandle] = []
        self._last_taken: tuple[list[Group], dict[int, int]] = ([], {})  # for `untake`
        self.num_in_flight_episodes = 0
        # episodes in flight integrated over time (episode-seconds): over a window, / its length = how many were in
        # flight on average; less the engine's requests per step, how many were between turns, on the agents' side
        self._episode_seconds, self._counted_at = 0.0, time.perf_counter()
        # how long the staleness bound, not the slots, kept a whole group's free slots empty (seconds, and since
        # when it does now): the engine then runs what is in flight only, waiting for the trainer's next version
        self._bound_seconds, self._bound_since = 0.0, None
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
        self._held_by_bound(not self._readmit and self._has_room())

    def _held_by_bound(self, held: bool) -> None:
        now = time.perf_counter()
        if self._bound_since is not None:
            self._bound_seconds += now - self._bound_since
        self._bound_since = now if held else None

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
                                                   self.cfg.temperature, self.cfg.top_p, self.routing))
            self._tasks.add(task)
            task.add_done_callback(lambda t, g=group: self._episode_done(g, t))
        self._count(self.cfg.group_size)

    def _count(self, change: int) -> None:
        now = time.perf_counter()
        self._episode_seconds += self.num_in_flight_episodes * (now - self._counted_at)
        self.num_in_flight_episodes, self._counted_at = self.num_in_flight_episodes + change, now

    def _episode_done(self, group: _InFlight, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return  # shutdown: the group stays in `in_flight` and is re-run from a checkpoint
        self._count(-1)
        exc = task.exception()
        if isinstance(exc, EngineUnreachable):
            group.engine_gone = str(exc) or type(exc).__name__
        elif exc is not None:
            log.warning("episode of group %d failed: %r", group.index, exc)
            group.failure = group.failure or f"{type(exc).__name__}: {exc}"
        elif (oldest := min((v for v in task.result().versions if v >= 0), default=group.start_version)) < \
                group.start_version:
            log.error("group %d: a token of weights version %d, older than its start version %d", group.index,
                      oldest, group.start_version)
            group.failure = group.failure or ("a token sampled under weights older than the episode's start version "
                                              "(an engine behind the current weights got traffic)")
        group.remaining -= 1
        if group.remaining == 0:
            del self.in_flight[group.index]
            if group.failure is None and group.engine_gone is not None:
                self._retry_later(group.index, group.engine_gone)
            elif group.failure is not None:
                self.dropped[group.failure] += 1
                self._dropped_indices.add(group.index)
                self._dropped_pending[group.index] = group.start_version
            else:
                self.buffer[group.index] = Group(group.index, group.episodes, group.start_version)
            self._batch_wake.set()
        self._admit_wake.set()

    def _retry_later(self, index: int, why: str) -> None:
        """Run a group the engine's unreachability cut short again after a back-off (a run whose engine died stops
        meanwhile, and its checkpoint lists the group for re-running); drop it after `ENGINE_RETRIES` runs."""
        self._engine_failures[index] += 1
        if self._engine_failures[index] >= ENGINE_RETRIES:
            self.dropped[f"the engine could not be reached in {ENGINE_RETRIES} runs of the group"] += 1
            self._dropped_indices.add(index)
            self._dropped_pending[index] = self.version()
            return
        log.warning("group %d: the engine could not be reached (%s); it runs again", index, why)
        self.rerun_groups += 1
        self._retrying.add(index)
        first = RETRY_DELAY_S if self.retry_delay_s is None else self.retry_delay_s
        delay = first * 2 ** (self._engine_failures[index] - 1)
        self._timers.append(asyncio.get_running_loop().call_later(delay, self._retry_now, index))

    def _retry_now(self, index: int) -> None:
        if index in self._retrying:
            self._retrying.discard(index)
            self._readmit.append(index)
            self._admit_wake.set()

    # ---- the trainer's side ------------------------------------------------------------------------------
    def _plan(self) -> list[int] | None:
        unconsumed = {i: g.start_version for i, g in self.in_flight.items()}
        unconsumed |= {i: g.start_version for i, g in self.buffer.items()} | self._dropped_pending
        unconsumed |= {i: self.version() for i in [*self._readmit, *self._retrying]}  # they start no earlier
        done = set(self.buffer) | set(self._dropped_pending)
        return plan_batch(self.batches_taken, self.cfg.batch_groups, self.cfg.max_staleness, self.cfg.batch_order,
                          unconsumed, done)

    def batch_ready(self) -> bool:
        return self._plan() is not None

    async def next_batch(self) -> list[Group]:
        """The next batch (`plan_batch`; dropped groups take their place in it but are left out), waiting for
        stragglers."""
        while (pick := self._plan()) is None:
            self._batch_wake.clear()
            await self._batch_wake.wait()
        dropped = {i: self._dropped_pending.pop(i) for i in pick if i in self._dropped_pending}
        self.batches_taken += 1
        batch = [self.buffer.pop(i) for i in pick if i in self.buffer]
        self._last_taken = batch, dropped
        return batch

    def untake(self) -> None:
        """Give back the batch `next_batch` last handed out, untrained (the trainer's step failed or was stopped):
        it is the next batch again, and a checkpoint keeps its groups."""
        self.buffer, self.batches_taken, self._dropped_pending = self._given_back()
        self._last_taken = [], {}
        self._batch_wake.set()

    def _given_back(self) -> tuple[dict[int, Group], int, dict[int, int]]:
        """The buffer, batches taken and dropped groups pending as they were before `next_batch` handed out its
        last batch (new dicts: the manager's own are left as they are)."""
        batch, dropped = self._last_taken
        return self.buffer | {g.index: g for g in batch}, self.batches_taken - 1, self._dropped_pending | dropped

    # ---- shutdown and checkpoints ------------------------------------------------------------------------
    async def stop(self) -> None:
        """Cancel the episodes in flight. Their groups stay recorded as in flight: `state_dict` lists them
        for re-running, so nothing admitted is lost across a checkpoint."""
        for task in list(self._tasks):
            task.cancel()
        for timer in self._timers:  # (groups waiting to re-run stay listed for it)
            timer.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def state_dict(self, trained_batches: int | None = None) -> dict:
        """`trained_batches`: the trainer's version, where a run may take the next batch before it checkpoints
        the last step (its end goes on beside the next batch's wait): the batch handed out and not trained yet is
        saved as it was before `next_batch`, so a resume trains it."""
        buffer, taken, dropped_pending = self.buffer, self.batches_taken, self._dropped_pending
        if trained_batches is not None and taken > trained_batches:
            assert taken == trained_batches + 1, f"{taken} batches taken, {trained_batches} trained"
            buffer, taken, dropped_pending = self._given_back()
        return {
            "next_index": self.next_index,
            "batches_taken": taken,
            "buffer": {i: asdict(g) for i, g in buffer.items()},
            "rerun": sorted(set(self.in_flight) | set(self._readmit) | self._retrying),
            "dropped": dict(self.dropped),
            "dropped_indices": sorted(self._dropped_indices),
            "dropped_pending": dict(dropped_pending),
        }

    def load_state_dict(self, state: dict) -> None:
        self.next_index, self.batches_taken = state["next_index"], state["batches_taken"]
        self.buffer = {int(i): Group(g["index"], [Episode(**e) for e in g["episodes"]], g["start_version"])
                       for i, g in state["buffer"].items()}
        self._readmit = list(state["rerun"])
        self.dropped = Counter(state["dropped"])
        self._dropped_indices = set(state["dropped_indices"])
        self._dropped_pending = {int(i): v for i, v in state.get("dropped_pending", {}).items()}

    def summary(self) -> dict:
        self._count(0)
        if self._bound_since is not None:
            self._held_by_bound(True)
        return {"in_flight_episodes": self.num_in_flight_episodes, "episode_seconds": self._episode_seconds,
                "bound_seconds": self._bound_seconds,
                "buffered_groups": len(self.buffer), "admitted_groups": self.next_index,
                "dropped_groups": sum(self.dropped.values()), "rerun_groups": self.rerun_groups}
