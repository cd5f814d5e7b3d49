"""Learnable tasks: small enough for a tiny model on CPU to improve within minutes, so that tests can
prove learning happens end to end."""

from __future__ import annotations

import random

from tandem.rollout.env import Environment, StepResult
from tandem.types import SamplingParams


class TargetTokensEnv(Environment):
    """Single turn: the reward is the fraction of generated tokens that fall in a target range (an eighth of
    the vocabulary), so a random policy starts near 0.125 and a learning one climbs towards 1."""

    response_len = 8

    def __init__(self, vocab_size: int, group_seed: int, sample: int):
        rng = random.Random(f"target-{group_seed}")
        self.prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(4, 12))]
        self.lo, self.hi = vocab_size // 2, vocab_size // 2 + max(1, vocab_size // 8)

    async def reset(self) -> list[int]:
        return list(self.prompt)

    def sampling(self, turn: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.response_len, ignore_eos=True)

    async def step(self, response: list[int]) -> StepResult:
        hits = sum(self.lo <= t < self.hi for t in response)
        return StepResult(done=True, reward=hits / max(1, len(response)))


class GuessNumberEnv(Environment):
    """Multi-turn: guess a hidden number in [0, K) with one token per turn (token `NUM0 + k` guesses k); the
    environment answers HIGHER or LOWER (or INVALID for a token that is no guess). Reward 1 for finding it,
    less the later it is found; a little credit per valid guess so a random policy gets a signal. Using the
    answers (binary search) is what it takes to find it within `max_turns`."""

    K, max_turns = 8, 4
    HIGHER, LOWER, INVALID, START, NUM0 = 2, 3, 4, 5, 16

    def __init__(self, vocab_size: int, group_seed: int, sample: int):
        if vocab_size < self.NUM0 + self.K:
            raise ValueError(f"guess_number: vocab_size must be at least {self.NUM0 + self.K}, got {vocab_size}")
        self.secret = random.Random(f"guess-{group_seed}").randrange(self.K)
        self.turn, self.valid = 0, 0

    async def reset(self) -> list[int]:
        return [self.START]

    def sampling(self, turn: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=1, ignore_eos=True)

    async def step(self, response: list[int]) -> StepResult:
        self.turn += 1
        guess = response[0] - self.NUM0
        if guess == self.secret:
            return StepResult(done=True, reward=1.0 - 0.1 * (self.turn - 1))
        self.valid += 0 <= guess < self.K
        if self.turn >= self.max_turns:
            return StepResult(done=True, reward=0.1 * self.valid / self.max_turns)
        if not 0 <= guess < self.K:
            return StepResult(observation=[self.INVALID])
        return StepResult(observation=[self.HIGHER if self.secret > guess else self.LOWER])
