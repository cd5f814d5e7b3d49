"""The environment interface: what a user writes to plug a task into tandem.

An episode: `reset()` gives the prompt tokens; then, turn after turn, the policy generates with
`sampling(turn)` and the environment answers `step(response)` with observation tokens (tool output, a
reply) or ends the episode with a reward. Every method may await (tool calls, sandboxes); none may block
the event loop. Environments of one group are built from the same `group_seed`, so they share their
prompt (and any hidden state): that is what makes GRPO's group baseline meaningful.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.types import SamplingParams


@dataclass(slots=True)
class StepResult:
    observation: list[int] = field(default_factory=list)  # appended to the context (loss mask 0)
    done: bool = False
    reward: float = 0.0  # read when done


class Environment(abc.ABC):
    @abc.abstractmethod
    async def reset(self) -> list[int]:
        """The prompt tokens."""

    @abc.abstractmethod
    def sampling(self, turn: int) -> SamplingParams:
        """Sampling parameters of the policy's turn `turn` (0-based). The agent loop lowers
        `max_new_tokens` to what the context limit leaves."""

    @abc.abstractmethod
    async def step(self, response: list[int]) -> StepResult:
        """React to the policy's response of this turn."""

    def truncated_reward(self) -> float:
        """The reward of an episode that ran out of context before the environment ended it."""
        return 0.0


# (group_seed, sample index within the group) -> a fresh environment for one episode; a run's task builds one
# (`tandem.rollout.registry`)
EnvFactory = Callable[[int, int], Environment]
