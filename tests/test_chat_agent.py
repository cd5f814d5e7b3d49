"""The tool-calling chat agent (tandem.rollout.chat_agent) and chat environments (tandem.rollout.chat_env): episodes
are the session's token history, and `tandem run task=chat_agent` learns."""

import asyncio

import openai
import pytest
from chat_models import chat_model_dir

from tandem.config import EngineConfig, RunConfig
from tandem.engine.engine import Engine
from tandem.rollout.agent import run_episode
from tandem.rollout.chat_agent import ChatAgentEnv, calculator
from tandem.rollout.chat_env import ChatEnvironment
from tandem.run.loop import run_recording
from tandem.types import Episode


class TwoTurns(ChatEnvironment):
    """Two turns, keeping what each reply said: through `chat.complete`, or as an agent written against the
    official OpenAI client would (its messages sent back as the client returned them)."""

    def __init__(self, with_openai: bool):
        self.with_openai, self.choices = with_openai, []

    async def play(self, chat) -> float:
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        client = openai.AsyncOpenAI(base_url=chat.base_url, http_client=chat.http, api_key="none")
        for follow_up in ("Are you sure?", None):
            if self.with_openai:
                reply = await client.chat.completions.create(model="any", messages=messages, max_tokens=6,
                                                             seed=len(self.choices), **chat.sampling)
                self.choices.append(reply.choices[0].model_dump())
            else:
                self.choices.append(await chat.complete(messages, max_tokens=6, seed=len(self.choices)))
            messages.append(self.choices[-1]["message"])
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
        return 0.5


@pytest.mark.parametrize("with_openai", [False, True])
def test_a_chat_episode_is_the_session_token_history(tmp_path, with_openai):
    chat_model_dir(tmp_path)
    with Engine(str(tmp_path), EngineConfig(page_size=16)) as engine:
        env = TwoTurns(with_openai)
        episode = asyncio.run(run_episode(engine, env, Episode("e", 0), max_context=4096))
    first, second = env.choices
    assert episode.reward == 0.5 and episode.num_turns == 2
    assert episode.tokens == second["prompt_token_ids"] + second["token_ids"]
    assert episode.tokens[:len(first["prompt_token_ids"]) + len(first["token_ids"])] == \
        first["prompt_token_ids"] + first["token_ids"]
    policy = [t for t, m in zip(episode.tokens, episode.loss_mask, strict=True) if m]
    assert policy == first["token_ids"] + second["token_ids"]
    logprobs = [lp for lp, m in zip(episode.behav_logprobs, episode.loss_mask, strict=True) if m]
    assert logprobs == [lp for c in env.choices for lp, _, _ in c["meta_info"]["output_token_logprobs"]]
    assert all((v >= 0) == bool(m) for v, m in zip(episode.versions, episode.loss_mask, strict=True))


class Scripted:
    """A session that replies with the given messages (the agent's logic alone; the endpoint is tested above)."""

    def __init__(self, *replies):
        self.replies, self.sent = list(replies), []

    async def complete(self, messages, tools=None, **params):
        self.sent.append(list(messages))
        return {"message": self.replies.pop(0)}


def call(expression):
    return {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "calculator", "arguments": f'{{"expression": "{expression}"}}'}}]}


@pytest.mark.parametrize("replies, reward", [
    ([call("3 + 4"), {"role": "assistant", "content": "7"}], 1.0),  # a call, then the right number
    ([{"role": "assistant", "content": "7 it is"}], 0.7),  # right without the tool
    ([{"role": "assistant", "content": "12"}], 0.2),  # a number, wrong
    ([call("3 +"), {"role": "assistant", "content": "so"}], 0.0),  # a malformed expression is no credit
])
def test_the_agent_calls_the_calculator_and_is_rewarded(replies, reward):
    env = ChatAgentEnv(group_seed=0)
    env.a, env.b = 3, 4
    session = Scripted(*replies)
    assert asyncio.run(env.play(session)) == pytest.approx(reward)
    if replies[0].get("tool_calls"):
        tool = session.sent[1][-1]
        assert tool["role"] == "tool" and tool["tool_call_id"] == "c1"
        assert tool["content"] == "7" if reward else tool["content"].startswith("error")
    assert calculator("2 * (3 + 4) - 10 / 5") == "12" and calculator("__import__('os')").startswith("error")


def test_tandem_run_trains_the_chat_agent(tmp_path):
    """On the tiny random model: reward from answering with a number, then with right ones (see chat_agent). The
    first step trains on tokens sampled under the trainer's own weights: equal logprobs prove the episode holds
    exactly the sampled ids."""
    # (lr 3e-2 climbs in 16 steps as far as 2e-2 did in 20: the last five steps' mean reward ~0.23 against ~0.20)
    run, history, _ = run_recording(RunConfig.load(None, [
        "task=chat_agent", "steps=16", "trainer.lr=3e-2", "rollout.group_size=8", f"out_dir={tmp_path}"]))
    rewards = [h["reward_mean"] for h in history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.1 and last > first + 0.1, rewards
    assert abs(history[0]["mismatch_kl"]) < 1e-6 and history[0]["dropped_groups"] == 0
