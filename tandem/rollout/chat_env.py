"""Chat environments: the policy is a chat agent, written as one is written against any OpenAI-compatible server,
and the episode the trainer gets is exactly what the engine sampled.

An episode: `play(chat)` holds one conversation through `chat`, a session of the engine's session-scoped chat
endpoint (`/sessions/{id}/v1/chat/completions`, `tandem.server.sessions`), and returns the reward. Then the
session's token history becomes the episode: the sampled ids with their logprobs and weight versions (loss mask 1),
the tokens of the messages the server rendered around them (loss mask 0). Nothing is re-tokenized on the way, so the
trainer scores the tokens the engine sampled, whatever the template and BPE would make of their text later.

Where the endpoint is: with the engine in this process (placement `colocated`, the default on the CPU), an app of the
OpenAI-compatible routes around it, called in process (httpx's ASGI transport: no socket, no port); with the engine
behind its HTTP server (placement `separate`), that server (its model directory must hold a tokenizer). A router
does not forward sessions (placement `disaggregated` is refused).
"""

from __future__ import annotations

import abc
import logging
import uuid
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from tandem.types import Episode

if TYPE_CHECKING:
    from tandem.engine.client import EngineClient
    from tandem.engine.engine import Engine

_CLIENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its endpoint's httpx client
logging.getLogger("httpx").setLevel(logging.WARNING)  # (it logs every request at INFO)


class ChatFailed(RuntimeError):
    """A chat request of an episode was refused (the reply's error message says why)."""


@dataclass(slots=True)
class ChatSession:
    """One episode's session. `base_url` serves an OpenAI client (`AsyncOpenAI(base_url=chat.base_url,
    http_client=chat.http)`); every request must sample with `sampling` (the run's temperature and top_p, which
    the trainer scores with)."""

    http: httpx.AsyncClient
    session_id: str
    sampling: dict

    @property
    def base_url(self) -> str:
        return f"{str(self.http.base_url).rstrip('/')}/sessions/{self.session_id}/v1"

    async def complete(self, messages: list[dict], tools: list[dict] | None = None, **params) -> dict:
        """One chat completion in this session (`params`: the body's other fields, e.g. `max_tokens`); returns its
        choice: `message` (content, tool_calls), `finish_reason`, `token_ids`... ChatFailed on an error reply."""
        body = {"messages": messages, **({"tools": tools} if tools else {}), **params, **self.sampling}
        reply = await self.http.post(f"/sessions/{self.session_id}/v1/chat/completions", json=body)
        if reply.status_code != 200:
            raise ChatFailed(f"chat completion refused ({reply.status_code}): {reply.text[:500]}")
        return reply.json()["choices"][0]


class ChatEnvironment(abc.ABC):
    """What a user writes to train a chat agent: `play`. `tokenizer`: the one to serve an in-process engine with
    when its model directory has none (the task's; None: the engine's)."""

    tokenizer = None

    @abc.abstractmethod
    async def play(self, chat: ChatSession) -> float:
        """Hold one conversation through `chat` (tools run here, awaited: nothing may block the event loop); return
        the episode's reward."""


async def run_chat_episode(client: Engine | EngineClient, env: ChatEnvironment, episode: Episode,
                           temperature: float = 1.0, top_p: float = 1.0) -> Episode:
    """Play `env` on `client`'s session endpoint into `episode` (mutated and returned): its tokens are the
    session's history, its reward what `play` returned. The session is deleted afterwards."""
    http = _endpoint(client, env.tokenizer)
    session = ChatSession(http, f"{episode.episode_id}-{uuid.uuid4().hex[:12]}",
                          {"temperature": temperature, "top_p": top_p})
    try:
        episode.reward = float(await env.play(session))
        reply = await http.get(f"/sessions/{session.session_id}")
        if reply.status_code != 200:
            raise ChatFailed(f"the session's history is gone ({reply.status_code}): {reply.text[:500]}")
        history = reply.json()
    finally:
        await http.delete(f"/sessions/{session.session_id}")
    tokens, mask = history["token_ids"], history["loss_mask"]
    start = 0
    for end in range(1, len(tokens) + 1):  # runs of equal loss mask
        if end == len(tokens) or mask[end] != mask[start]:
            policy = bool(mask[start])
            episode.add(tokens[start:end], policy, history["logprobs"][start:end] if policy else None,
                        history["weight_versions"][start:end] if policy else None)
            start = end
    episode.num_turns = history["num_turns"]
    return episode


def _endpoint(client: Engine | EngineClient, tokenizer) -> httpx.AsyncClient:
    """The httpx client of `client`'s chat endpoint (one per engine, made on first use)."""
    from tandem.engine.client import EngineClient
    from tandem.engine.engine import Engine

    if client not in _CLIENTS:
        if isinstance(client, Engine):
            from fastapi import FastAPI

            from tandem.server import openai_api

            app = FastAPI()
            openai_api.add_routes(app, client, tokenizer=tokenizer)
            _CLIENTS[client] = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://engine",
                                                 timeout=None)
        elif isinstance(client, EngineClient):
            _CLIENTS[client] = httpx.AsyncClient(base_url=client.url, timeout=None)
        else:
            raise ValueError(f"run.placement: a chat environment needs an engine or one engine's server, not a "
                             f"{type(client).__name__} (a router does not forward sessions)")
    return _CLIENTS[client]
