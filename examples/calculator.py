"""A user-defined environment: multi-turn arithmetic with a calculator tool.

The prompt asks for `a + b` (two-digit numbers, as digit tokens). Each turn the agent either calls the calculator,
`CALC x op y`, whose answer (`RESULT` and the digits, or `ERROR`) comes back to it as observation tokens, or answers,
`ANSWER` and digits, which ends the episode. Every turn is `response_len` tokens; what follows a number is ignored.
Reward 1 for the right answer; without one, a little credit per well-formed calculator call, so that a policy that
learns to use the tool gets a signal before it learns to answer.

Run it (from anywhere, with this folder importable):

    PYTHONPATH=examples tandem run task=calculator:task
"""

from __future__ import annotations

import asyncio
import random

from tandem.config import RunConfig
from tandem.rollout.env import EnvFactory, Environment, StepResult
from tandem.types import SamplingParams

DIGIT0 = 10  # tokens 10..19 are the digits 0..9
PLUS, TIMES, CALC, ANSWER, RESULT, ERROR, QUESTION = range(20, 27)
OPERATORS = {PLUS: int.__add__, TIMES: int.__mul__}


def digits(n: int) -> list[int]:
    return [DIGIT0 + int(c) for c in str(n)]


def leading_number(tokens: list[int]) -> tuple[int | None, list[int]]:
    """The number that the leading digit tokens spell (None without any), and the tokens after them."""
    n = 0
    while n < len(tokens) and DIGIT0 <= tokens[n] < DIGIT0 + 10:
        n += 1
    return (int("".join(str(t - DIGIT0) for t in tokens[:n])) if n else None), tokens[n:]


def calculator(expression: list[int]) -> list[int]:
    """The tool: `x op y` in tokens (anything after is ignored) -> `RESULT` and the digits, else `ERROR`."""
    x, rest = leading_number(expression)
    y, _ = leading_number(rest[1:])
    if x is None or y is None or rest[0] not in OPERATORS:
        return [ERROR]
    return [RESULT, *digits(OPERATORS[rest[0]](x, y))]


class CalculatorEnv(Environment):
    max_turns, response_len = 3, 6

    def __init__(self, group_seed: int):
        rng = random.Random(f"calculator-{group_seed}")  # the group's episodes share the question
        self.a, self.b = rng.randrange(10, 100), rng.randrange(10, 100)
        self.turn = self.tool_calls = 0

    async def reset(self) -> list[int]:
        return [QUESTION, *digits(self.a), PLUS, *digits(self.b)]

    def sampling(self, turn: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.response_len, ignore_eos=True)

    async def step(self, response: list[int]) -> StepResult:
        self.turn += 1
        if response[0] == ANSWER:
            return StepResult(done=True, reward=float(leading_number(response[1:])[0] == self.a + self.b))
        # anything else goes to the tool; a real one would await a sandbox or a server, never block the loop
        output = await asyncio.to_thread(calculator, response[1:] if response[0] == CALC else [])
        self.tool_calls += output[0] == RESULT
        if self.turn >= self.max_turns:
            return StepResult(done=True, reward=0.1 * self.tool_calls / self.max_turns)
        return StepResult(observation=output)


def task(cfg: RunConfig, vocab_size: int) -> EnvFactory:
    """What `task=calculator:task` names: called once per run, returns the per-episode factory."""
    if vocab_size <= QUESTION:
        raise ValueError(f"run.task: calculator needs a vocabulary of more than {QUESTION} tokens, got {vocab_size}")
    return lambda group_seed, sample: CalculatorEnv(group_seed)
