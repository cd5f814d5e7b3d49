"""A user's own environment, loaded by `task=package.module:function`: the example calculator (a multi-turn tool
environment in examples/) through the real `tandem run`, from outside the package; and the resolver's errors."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.config import RunConfig
from tandem.rollout.registry import TASKS, resolve_task
from tandem.run import main as run_main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def calculator(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import calculator

    return calculator


def test_registered_names_and_import_paths_resolve(calculator):
    assert set(TASKS) == {"random", "target_tokens", "guess_number", "chat_agent"}
    assert resolve_task("random") is TASKS["random"]
    assert resolve_task("calculator:task") is calculator.task


@pytest.mark.parametrize("spec, says", [
    ("no_such_task", "neither a registered task (random, target_tokens, guess_number, chat_agent) nor "
                     "package.module:function"),
    ("no_such_module_xyz:task", "cannot import module 'no_such_module_xyz'"),
    ("calculator:no_such_function", "has nothing named 'no_such_function'"),
    ("calculator:DIGIT0", "has a int named 'DIGIT0', not a function"),
    (":task", "neither a registered task"),
])
def test_a_bad_task_is_a_value_error_naming_the_field_and_what_was_tried(calculator, spec, says):
    with pytest.raises(ValueError, match="run.task") as e:
        resolve_task(spec)
    assert says in str(e.value) and repr(spec) in str(e.value)


def test_the_calculator_answers_tool_calls_and_rewards_the_right_answer(calculator):
    c = calculator
    make_env = resolve_task("calculator:task")(RunConfig(), 512)

    async def play(*responses):
        env = make_env(7, 0)
        prompt = await env.reset()
        return prompt, env, [await env.step(r) for r in responses]

    prompt, env, (call, wrong) = asyncio.run(play([c.CALC, *c.digits(12), c.PLUS, *c.digits(30)], [c.ANSWER, c.DIGIT0]))
    assert call.observation == [c.RESULT, *c.digits(42)] and not call.done  # the tool's tokens go back to the agent
    assert prompt == [c.QUESTION, *c.digits(env.a), c.PLUS, *c.digits(env.b)]
    assert wrong.done and wrong.reward == 0.0
    _, env, (_, right) = asyncio.run(play([7] * 6, [c.ANSWER, *c.digits(env.a + env.b), 0]))
    assert right.done and right.reward == 1.0
    _, _, turns = asyncio.run(play([c.CALC, c.PLUS], [c.CALC, *c.digits(3), c.TIMES, *c.digits(4)], [0] * 6))
    assert turns[0].observation == [c.ERROR] and turns[1].observation == [c.RESULT, *c.digits(12)]
    assert turns[2].done and turns[2].reward == pytest.approx(0.1 / 3)  # one well-formed call in three turns


def test_tandem_run_trains_on_a_user_environment_from_outside_the_package(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES), "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([sys.executable, "-m", "tandem.cli", "run", "task=calculator:task", "steps=2",
                          "out_dir=run", "rollout.group_size=2", "rollout.batch_groups=2", "rollout.num_in_flight=4"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    prompt_len = 6
    for r in records:  # the calculator's output tokens are in the context, outside the loss
        assert r["tokens_total"] - r["tokens_trained"] > r["num_episodes"] * prompt_len


def test_tandem_run_names_a_bad_task_before_it_starts_the_engine(calculator, monkeypatch, tmp_path):
    monkeypatch.setattr(run_main, "Run", lambda cfg: pytest.fail("the run started"))
    with pytest.raises(ValueError, match="run.task: 'calculator:nope'"):
        run_main.main(None, ["task=calculator:nope", f"out_dir={tmp_path}"])
