"""Session-scoped chat: the server keeps each conversation's token history, so a multi-turn agent's trainer gets
exactly the tokens that were sampled (Miles' "tokens in, tokens out").

A session's history is every token its requests sent to the engine and got back: the first prompt, then each
turn's sampled ids and the tokens of the messages appended after them. A request *extends* the session when its
messages start with the ones the session has seen (those of its previous request, and the assistant message it
returned, compared in `chat.normalize`'s form) with the same tools and template arguments; then the prompt is the
history as it is plus only the appended messages, tokenized alone (`chat.render_suffix`; an end-of-turn token is
added first if the last turn ended without one: cut by length or a stop string). Anything else *falls back*: the
whole conversation is rendered and tokenized again, the history starts over from it (the earlier sampled ids are
then gone from it: what the template and BPE make of their text replaces them), and the fallback is counted in the
reply and the store's counters. The first request of a session is neither.

Bounds: at most `max_sessions` (the least recently used is evicted to admit another), each holding at most the
engine's context (17 bytes a token: arrays, not lists); a session unused for `ttl_s` expires; `DELETE
/sessions/{id}` ends one. One request at a time per session (another is refused: 409).
"""

from __future__ import annotations

import asyncio
import re
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from tandem.server import chat

SESSION_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


@dataclass(slots=True)
class Prompt:
    """A session request's prompt: `ids` to send; `reused` tokens of it are the history, the rest appended."""

    ids: list[int]
    reused: int
    fallback: bool


@dataclass(slots=True)
class Session:
    """A session's token history, as parallel arrays: `tokens`, `loss_mask` (1: sampled by the engine), `logprobs`
    and `weight_versions` (the sampled tokens'; 0.0 and -1 for the rest)."""

    id: str
    tokens: array = field(default_factory=lambda: array("i"))
    loss_mask: array = field(default_factory=lambda: array("b"))
    logprobs: array = field(default_factory=lambda: array("d"))
    weight_versions: array = field(default_factory=lambda: array("i"))
    seen: list[dict] = field(default_factory=list)  # normalised messages, through the last reply
    context: tuple = ()  # (tools, template arguments) of the history
    num_turns: int = 0
    num_reused: int = 0
    num_fallbacks: int = 0
    last_used: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def prompt(self, tokenizer, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None) -> Prompt:
        """The prompt of a request with these (normalised) messages. Changes nothing."""
        context = (tools, template_kwargs)
        n = len(self.seen)
        if n and context == self.context and messages[:n] == self.seen:
            try:
                suffix = chat.render_suffix(tokenizer, messages[n:], tools, template_kwargs)
            except chat.NotAppendable:
                pass
            else:
                close = [] if self.tokens[-1] == tokenizer.eos_token_id else [tokenizer.eos_token_id]
                ids = self.tokens.tolist() + close + chat.encode(tokenizer, suffix)
                return Prompt(ids, len(self.tokens), False)
        full = chat.encode(tokenizer, chat.render(tokenizer, messages, tools, template_kwargs))
        return Prompt(full, 0, fallback=n > 0)

    def record(self, prompt: Prompt, messages: list[dict], reply: dict, tools, template_kwargs, output) -> None:
        """Keep a finished turn: `prompt` as sent, `output` (a GenerateOutput, cut to what was returned) and the
        `reply` message returned for `messages`."""
        if prompt.reused == 0:
            for column in (self.tokens, self.loss_mask, self.logprobs, self.weight_versions):
                del column[:]
        appended = prompt.ids[prompt.reused:]
        self.tokens.extend(appended + output.output_ids)
        self.loss_mask.extend([0] * len(appended) + [1] * len(output.output_ids))
        self.logprobs.extend([0.0] * len(appended) + list(output.output_logprobs))
        self.weight_versions.extend([-1] * len(appended) + list(output.weight_versions))
        self.seen = [*messages, chat.normalize(reply)]
        self.context = (tools, template_kwargs)
        self.num_turns += 1
        self.num_reused += prompt.reused > 0
        self.num_fallbacks += prompt.fallback

    def to_dict(self) -> dict:
        """The history, as a trainer takes it (parallel lists, one entry per token)."""
        return {"id": self.id, "token_ids": self.tokens.tolist(), "loss_mask": self.loss_mask.tolist(),
                "logprobs": self.logprobs.tolist(), "weight_versions": self.weight_versions.tolist(),
                "num_turns": self.num_turns,
                "num_reused": self.num_reused, "num_fallbacks": self.num_fallbacks}


class SessionStore:
    """The sessions of one server, bounded in number and idle time. Counters (`stats`): sessions created, expired,
    evicted and deleted; turns, of which extended the history (reused) or fell back."""

    def __init__(self, max_sessions: int = 1024, ttl_s: float = 3600.0, clock=time.monotonic):
        if max_sessions < 1 or not ttl_s > 0:
            raise ValueError(f"sessions: max_sessions must be >= 1 and ttl_s > 0, got {max_sessions}, {ttl_s}")
        self.max_sessions, self.ttl_s, self.clock = max_sessions, ttl_s, clock
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.counts = dict(created=0, expired=0, evicted=0, deleted=0, turns=0, reused=0, fallbacks=0)

    def get(self, session_id: str, create: bool = False) -> Session | None:
        """The session (touched: now the most recently used), created if `create`; None if there is none."""
        if not SESSION_ID.fullmatch(session_id):
            raise ValueError(f"session_id: must be 1 to 128 of A-Z a-z 0-9 _ . : -, got {session_id[:140]!r}")
        self._expire()
        session = self.sessions.get(session_id)
        if session is None and create:
            while len(self.sessions) >= self.max_sessions:
                self.sessions.popitem(last=False)
                self.counts["evicted"] += 1
            session = self.sessions[session_id] = Session(session_id)
            self.counts["created"] += 1
        if session is not None:
            session.last_used = self.clock()
            self.sessions.move_to_end(session_id)
        return session

    def delete(self, session_id: str) -> bool:
        self._expire()
        found = self.sessions.pop(session_id, None) is not None
        self.counts["deleted"] += found
        return found

    def count_turn(self, prompt: Prompt) -> None:
        self.counts["turns"] += 1
        self.counts["reused"] += prompt.reused > 0
        self.counts["fallbacks"] += prompt.fallback

    def stats(self) -> dict:
        self._expire()
        return {"active": len(self.sessions), "max_sessions": self.max_sessions, "ttl_s": self.ttl_s, **self.counts}

    def _expire(self) -> None:
        deadline = self.clock() - self.ttl_s
        while self.sessions and next(iter(self.sessions.values())).last_used < deadline:
            self.sessions.popitem(last=False)
            self.counts["expired"] += 1
