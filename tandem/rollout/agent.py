"""The multi-turn agent loop: one episode, driven through any engine client token-in, token-out."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from tandem.rollout.chat_env import ChatEnvironment, run_chat_episode
from tandem.rollout.env import Environment
from tandem.types import PAUSED_ABORT, Episode, GenerateOutput, SamplingParams


class GenerateClient(Protocol):
    """What the rollout side needs of an engine: the in-process `Engine`, or an HTTP client of one."""

    async def generate(self, input_ids: list[int], sampling: SamplingParams | None = None,
                       rid: str | None = None, return_routed_experts: bool = False) -> GenerateOutput: ...


class EpisodeFailed(RuntimeError):
    """An episode that cannot be completed (the engine aborted it for a reason other than a pause)."""


async def run_episode(client: GenerateClient, env: Environment, episode: Episode, max_context: int,
                      temperature: float = 1.0, top_p: float = 1.0, routing: bool = False) -> Episode:
    """Play one episode into `episode` (mutated in place and returned). The policy samples with the RL run's
    `temperature` and `top_p` (the trainer must score tokens with the same temperature), the environment
    sets the rest of each turn's sampling parameters. Each turn resubmits the whole
    history, so the engine's prefix cache serves everything computed before. A turn cut short by an
    abort-mode pause is resubmitted with its partial output and stitched together; every token keeps the
    weight version it was sampled under. With `routing`, every generate asks for the routed experts, and the episode
    keeps one row per token (`Episode.keep_routing`: each request's rows cover the whole history it was given).
    A chat environment (`tandem.rollout.chat_env`) plays through the engine's session chat endpoint instead."""
    if isinstance(env, ChatEnvironment):
        if routing:
            raise EpisodeFailed("chat environments do not keep routed experts yet")
        return await run_chat_episode(client, env, episode, temperature, top_p)
    await _play(client, env, episode, max_context, temperature, top_p, routing)
    if routing:
        episode.keep_routing()  # rows of -1 for what followed the last generate
    return episode


async def _play(client: GenerateClient, env: Environment, episode: Episode, max_context: int, temperature: float,
                top_p: float, routing: bool) -> None:
    episode.add(await env.reset(), policy=False)
    for turn in range(max_context):
        room = max_context - len(episode.tokens)
        if room <= 0:
            episode.truncated, episode.reward = True, env.truncated_reward()
            return
        sampling = env.sampling(turn)
        sampling = dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room),
                                       temperature=temperature, top_p=top_p)
        response = await _generate(client, episode, sampling, routing)
        episode.num_turns += 1
        result = await env.step(response)
        if result.done:
            episode.reward = float(result.reward)
            return
        obs = result.observation[:max_context - len(episode.tokens)]
        episode.add(obs, policy=False)
    raise AssertionError("unreachable: every turn adds at least one token")


async def _generate(client: GenerateClient, episode: Episode, sampling: SamplingParams, routing: bool) -> list[int]:
    response: list[int] = []
    while True:
        remaining = sampling.max_new_tokens - len(response)
        routed = {"return_routed_experts": True} if routing else {}  # (a client need not know the argument)
        out = await client.generate(episode.tokens, dataclasses.replace(sampling, max_new_tokens=remaining), **routed)
        episode.add(out.output_ids, policy=True, logprobs=out.output_logprobs, versions=out.weight_versions)
        if routing and out.routed_experts is not None:
            episode.keep_routing(out.routed_experts)
        elif routing and out.finish_reason.type != "abort":  # (an aborted request's rows come with its resubmission)
            raise EpisodeFailed("the engine returned no routed experts (is enable_return_routed_experts on?)")
        response += out.output_ids
        if out.finish_reason.type != "abort":
            return response
        if out.finish_reason.message != PAUSED_ABORT:
            raise EpisodeFailed(f"engine aborted the request: {out.finish_reason.message}")
        episode.num_resubmits += 1
        if len(response) >= sampling.max_new_tokens:
            return response
