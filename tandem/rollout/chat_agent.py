"""A tool-calling chat agent, the example to copy when you wrap your own: `tandem run task=chat_agent`.

The agent is asked "What is a + b?" (a and b in 0..4) with a calculator tool. Each turn it replies through the
session chat endpoint (`tandem.rollout.chat_env`); a reply with tool calls gets the calculator's results as tool
messages and another turn, any other reply is its answer. Reward (shaped, so a model with random weights gets a
signal): 0.5 if the answer's first number is a + b, 0.3 if a calculator call was well formed (it parsed as a tool
call and the calculator could evaluate it), 0.2 if the answer starts with a number. On the tiny random model a
well-formed call (a JSON object between `<tool_call>` tokens) is out of reach, so what its reward climbs on within
minutes is answering with a number, and then with the likeliest right ones; a pretrained model starts where the
tool call pays.

The model's tokenizer and chat template come from its directory; for a preset without one (the default `tiny`),
the task trains the shipped test tokenizer (`tandem.tokenizer.train_tokenizer`) into `out_dir/tokenizer` and the
in-process endpoint serves with it (placement `colocated` only: `separate` needs a model directory that holds a
tokenizer, since the engine's server has only its own; `disaggregated` is refused, a router forwards no sessions).
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import random
import re
from pathlib import Path

from tandem.config import RunConfig
from tandem.rollout.chat_env import ChatEnvironment, ChatSession
from tandem.rollout.env import EnvFactory
from tandem.tokenizer import load_tokenizer, train_tokenizer

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression of integers with + - * /",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
SYSTEM = "Answer with a number. Use the calculator tool when it helps."
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """The tool: an arithmetic expression of integers -> its value, or an error message (never raises)."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("not an arithmetic expression of integers")
    try:
        if len(expression) > 100:
            raise ValueError("too long")
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(result) if float(result).is_integer() else result)


class ChatAgentEnv(ChatEnvironment):
    max_turns, max_tokens = 3, 12

    def __init__(self, group_seed: int, tokenizer=None):
        rng = random.Random(f"chat-agent-{group_seed}")  # the group's episodes share the question
        self.a, self.b = rng.randrange(5), rng.randrange(5)
        self.tokenizer = tokenizer

    async def play(self, chat: ChatSession) -> float:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {self.a} + {self.b}?"}]
        called = False
        for _ in range(self.max_turns):
            choice = await chat.complete(messages, tools=[CALCULATOR], max_tokens=self.max_tokens)
            message = choice["message"]
            messages.append(message)  # sent back as returned: the session extends its token history
            if not message.get("tool_calls"):
                break
            for call in message["tool_calls"]:
                # a real tool would await a sandbox or a server; this one is quick, but the pattern is the same
                result = await asyncio.to_thread(_run_call, call)
                called |= not result.startswith("error")
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        answer = (messages[-1].get("content") or "") if messages[-1]["role"] == "assistant" else ""
        number = re.match(r"\s*(-?\d+)", answer)
        right = number is not None and int(number.group(1)) == self.a + self.b
        return 0.5 * right + 0.3 * called + 0.2 * (number is not None)


def _run_call(call: dict) -> str:
    function = call["function"]
    if function["name"] != "calculator":
        return f"error: no tool named {function['name']!r}"
    expression = json.loads(function["arguments"]).get("expression")
    return calculator(expression) if isinstance(expression, str) else "error: expression must be a string"


def task(cfg: RunConfig, vocab_size: int) -> EnvFactory:
    """What `task=chat_agent` names: the tokenizer found or made once per run, then one environment per episode."""
    if cfg.placement == "disaggregated":
        raise ValueError("run.placement: chat_agent talks to the engine's session endpoint, which a router does not "
                         "forward; use placement colocated or separate")
    tokenizer = load_tokenizer(cfg.model, vocab_size)
    if tokenizer is None:
        if cfg.placement != "colocated":
            raise ValueError(f"run.task: chat_agent with placement {cfg.placement} needs a model directory that "
                             f"holds a tokenizer ({cfg.model!r} has none), or placement=colocated")
        tokenizer = train_tokenizer(Path(cfg.out_dir) / "tokenizer", vocab_size=min(400, vocab_size))
    return lambda group_seed, sample: ChatAgentEnv(group_seed, tokenizer)
