"""The random agent: the stress test and main demo. No dataset, no reward model; every knob in
`RandomAgentConfig`; everything reproducible from the group seed."""

from __future__ import annotations

import asyncio
import math
import random

from tandem.config import RandomAgentConfig
from tandem.rollout.env import Environment, StepResult
from tandem.types import SamplingParams


class RandomAgentEnv(Environment):
    def __init__(self, cfg: RandomAgentConfig, vocab_size: int, group_seed: int, sample: int):
        self.cfg, self.vocab_size = cfg, vocab_size
        group_rng = random.Random(f"random-agent-prompt-{group_seed}")  # shared by the group
        self.prompt = self._tokens(group_rng, group_rng.randint(cfg.prompt_len_min, cfg.prompt_len_max))
        self.rng = random.Random(f"random-agent-{group_seed}-{sample}")
        self.num_turns = self.rng.randint(cfg.turns_min, cfg.turns_max)
        self.reward = self.rng.uniform(-1.0, 1.0)
        self.turn = 0

    def _tokens(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(self.vocab_size) for _ in range(n)]

    async def reset(self) -> list[int]:
        return list(self.prompt)

    def sampling(self, turn: int) -> SamplingParams:
        cfg = self.cfg
        length = self.rng.lognormvariate(math.log(cfg.response_len_median), cfg.response_len_sigma)
        return SamplingParams(max_new_tokens=max(1, min(cfg.response_len_max, round(length))), ignore_eos=True)

    async def step(self, response: list[int]) -> StepResult:
        self.turn += 1
        if self.turn >= self.num_turns:
            return StepResult(done=True, reward=self.reward)
        if self.cfg.tool_latency_s > 0:
            await asyncio.sleep(self.rng.expovariate(1.0 / self.cfg.tool_latency_s))
        num_obs = min(self.cfg.obs_len_max, round(self.cfg.obs_ratio * len(response)))
        return StepResult(observation=self._tokens(self.rng, max(1, num_obs)))

    def truncated_reward(self) -> float:
        return self.reward
