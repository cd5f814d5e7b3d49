"""OpenAI-compatible endpoints, and session-scoped chat with exact token histories.

Routes: `GET /v1/models`; `POST /v1/completions`, `/v1/chat/completions` (bodies: `tandem.server.openai_bodies`),
with `stream` (server-sent events of OpenAI's chunks, then `data: [DONE]`), `n`, `seed` (choice j samples with
seed + j), `stop` (strings; `stop_token_ids` too), `logprobs` (the sampled tokens'; `top_logprobs` > 0 is refused:
the engine computes no alternatives), `max_tokens` / `max_completion_tokens` (default: what the context leaves),
`tools` (rendered by the model's chat template; `<tool_call>` JSON in the reply becomes `message.tool_calls`).
Session-scoped chat (`tandem.server.sessions`): `POST /sessions/{id}/v1/chat/completions` (the same body, n = 1),
`GET /sessions/{id}` (its token history: ids, loss mask, logprobs, weight versions), `DELETE /sessions/{id}`,
`GET /sessions` (the store's counters: turns, reused, fallbacks, expiries...).

Exact tokens (field names of SGLang's `return_token_ids`, sglang#30917, which vLLM's also uses): every choice
carries `prompt_token_ids` (what the engine was given) and `token_ids` (what it sampled, through the token that
completed a stop string; the text stops before it), and `meta_info`, the object `/generate` returns
(`output_token_logprobs` as [logprob, id, null], `output_token_weight_versions`, `weight_version`, `cached_tokens`);
a session reply also carries `session` (`reused_tokens`, `appended_tokens`, `fallback`, `num_fallbacks`).

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (a chat request
to a server without a tokenizer too), 404 for an unknown session, 409 for a session busy with another request.
A request cut short by an abort-mode pause is continued from where it stopped, as the rollout's agent loop does.
Streams are sent once the choices are complete (the engine returns a request's tokens when it finishes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tandem.engine.engine import Engine, EngineError
from tandem.server import chat
from tandem.server.openai_bodies import ChatBody, CompletionBody, OpenAIError, _Body
from tandem.server.sessions import SessionStore
from tandem.types import PAUSED_ABORT, FinishReason, GenerateOutput, SamplingParams

# where an engine's field names differ from OpenAI's
_PARAM = {"input_ids": "prompt", "sampling_params.max_new_tokens": "max_tokens"}


@dataclasses.dataclass(slots=True)
class Choice:
    """One sampled completion: `out` cut at a stop string (ids, logprobs, versions), its text, OpenAI's finish."""

    prompt_ids: list[int]
    out: GenerateOutput
    text: str
    finish: str  # "stop" | "length"
    stop: str | None = None  # the stop string that ended it

    def meta_info(self) -> dict:
        meta = self.out.meta_info(return_logprob=True)
        if self.stop is not None:
            meta["finish_reason"] = {"type": "stop", "matched": self.stop}
        return meta


def add_routes(app: FastAPI, engine: Engine, sessions: SessionStore | None = None, tokenizer=None) -> None:
    """Add the OpenAI-compatible and session routes to `app`, serving `engine` with `tokenizer` (default:
    `engine.tokenizer`). `sessions`: the store of session histories (default: `SessionStore()`'s bounds); kept as
    `app.state.sessions`."""
    from tandem.server.http import _unless_disconnected  # (http imports this module)

    store = app.state.sessions = sessions or SessionStore()
    tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
    model_id = Path(tokenizer.name_or_path).name if tokenizer is not None else "tandem"

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": int(time.time()),
                                            "owned_by": "tandem", "max_model_len": engine.max_context_len}]}

    @app.post("/v1/completions")
    @_openai_errors
    async def completions(request: Request):
        body = await CompletionBody.from_request(request)
        if body.logprobs:
            raise OpenAIError("logprobs: only 0 (the sampled token's logprob) is supported; the engine computes no "
                              "alternatives", "logprobs")
        prompts = _prompt_ids(body.prompt, tokenizer)
        jobs = [(p, _sampling(body, p, engine, seed_offset=j, stop_ids=())) for p in prompts for j in range(body.n)]
        choices = await _unless_disconnected(request, _sample_all(engine, tokenizer, jobs, body))
        if choices is None:
            return Response(status_code=499)
        reply = _reply("cmpl", "text_completion", model_id, choices)
        if body.stream:
            return _stream(_completion_chunks(reply, choices, body, tokenizer))
        reply["choices"] = [_completion_choice(i, c, body, tokenizer) for i, c in enumerate(choices)]
        return _json(reply)

    @app.post("/v1/chat/completions")
    @_openai_errors
    async def chat_completions(request: Request):
        body, messages, tools = await _chat_request(request, tokenizer)
        prompt = chat.encode(tokenizer, chat.render(tokenizer, messages, tools, body.chat_template_kwargs))
        sampled = await chat_sample(request, body, [prompt] * body.n)
        if sampled is None:
            return Response(status_code=499)
        return _stream(_chat_chunks(sampled[0], body)) if body.stream else _json(sampled[0])

    @app.post("/sessions/{session_id}/v1/chat/completions")
    @_openai_errors
    async def session_chat(session_id: str, request: Request):
        body, messages, tools = await _chat_request(request, tokenizer)
        if body.n != 1:
            raise OpenAIError("n: a session continues one conversation; send n = 1", "n")
        session = store.get(session_id, create=True)
        if session.lock.locked():
            raise OpenAIError(f"session {session_id!r} is busy with another request", status=409, code="busy")
        async with session.lock:
            prompt = session.prompt(tokenizer, messages, tools, body.chat_template_kwargs)
            sampled = await chat_sample(request, body, [prompt.ids])
            if sampled is None:
                return Response(status_code=499)
            reply, choices = sampled
            store.count_turn(prompt)
            session.record(prompt, messages, reply["choices"][0]["message"], tools, body.chat_template_kwargs,
                           choices[0].out)
        reply["session"] = {"id": session_id, "reused_tokens": prompt.reused,
                            "appended_tokens": len(prompt.ids) - prompt.reused, "fallback": prompt.fallback,
                            "num_fallbacks": session.num_fallbacks}
        return _stream(_chat_chunks(reply, body)) if body.stream else _json(reply)

    @app.get("/sessions")
    async def session_stats():
        return store.stats()

    @app.get("/sessions/{session_id}")
    @_openai_errors
    async def session_history(session_id: str):
        session = store.get(session_id)
        if session is None:
            raise OpenAIError(f"no session {session_id!r} (never created, expired, evicted or deleted)",
                              status=404, code="session_not_found")
        return _json(session.to_dict())

    @app.delete("/sessions/{session_id}")
    @_openai_errors
    async def delete_session(session_id: str):
        if not store.delete(session_id):
            raise OpenAIError(f"no session {session_id!r}", status=404, code="session_not_found")
        return {"id": session_id, "object": "session", "deleted": True}

    async def chat_sample(request: Request, body: ChatBody,
                          prompts: list[list[int]]) -> tuple[dict, list[Choice]] | None:
        """The chat reply to `prompts` (one per choice) and its choices; None if the client went away."""
        stop_ids = () if body.ignore_eos else (tokenizer.eos_token_id,)
        jobs = [(p, _sampling(body, p, engine, j, stop_ids)) for j, p in enumerate(prompts)]
        choices = await _unless_disconnected(request, _sample_all(engine, tokenizer, jobs, body))
        if choices is None:
            return None
        reply = _reply("chatcmpl", "chat.completion", model_id, choices)
        reply["choices"] = [_chat_choice(i, c, body, tokenizer) for i, c in enumerate(choices)]
        return reply, choices


# ---- requests ----------------------------------------------------------------------------------------------
def _openai_errors(route):
    """Reply to a refused request in OpenAI's error shape (a ValueError's field mapped to OpenAI's name)."""
    @functools.wraps(route)
    async def wrapper(*args, **kwargs):
        try:
            return await route(*args, **kwargs)
        except OpenAIError as e:
            return _json(e.body(), e.status)
        except (ValueError, EngineError) as e:
            message = str(e)
            field = message.split(":", 1)[0] if ":" in message and " " not in message.split(":", 1)[0] else None
            param = _PARAM.get(field, field.removeprefix("sampling_params.") if field else None)
            return _json(OpenAIError(message, param).body(), 400)
    return wrapper


def _need_tokenizer(tokenizer, what: str) -> None:
    if tokenizer is None:
        raise OpenAIError(f"{what} needs a tokenizer, and this server has none: serve a model directory holding "
                          "tokenizer.json and tokenizer_config.json", code="no_tokenizer")


async def _chat_request(request: Request, tokenizer) -> tuple[ChatBody, list[dict], list[dict] | None]:
    """The body, its messages normalised (`chat.normalize`) and its tools as the template takes them."""
    body = await ChatBody.from_request(request)
    _need_tokenizer(tokenizer, "chat")
    if body.top_logprobs:
        raise OpenAIError("top_logprobs: only 0 is supported; the engine returns the sampled token's logprob only",
                          "top_logprobs")
    messages = [chat.normalize(m) for m in body.messages]
    tools = [t.model_dump() for t in body.tools] if body.tools and body.tool_choice != "none" else None
    return body, messages, tools


def _prompt_ids(prompt, tokenizer) -> list[list[int]]:
    """A completion's prompts as token ids (strings need the tokenizer)."""
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    if any(isinstance(p, str) for p in prompts):
        _need_tokenizer(tokenizer, "a text prompt")
    ids = [chat.encode(tokenizer, p) if isinstance(p, str) else p for p in prompts]
    if any(not p for p in ids):
        raise OpenAIError("prompt: a prompt is empty", "prompt")
    return ids


def _sampling(body: _Body, prompt: list[int], engine: Engine, seed_offset: int, stop_ids: tuple) -> SamplingParams:
    limit = body.token_limit if isinstance(body, ChatBody) else body.max_tokens
    if limit is None:
        limit = max(0, engine.max_context_len - len(prompt))
    seed = None if body.seed is None else (body.seed + seed_offset) % 2**63
    return SamplingParams(max_new_tokens=limit, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                          min_p=body.min_p, ignore_eos=body.ignore_eos, seed=seed,
                          stop_token_ids=tuple(body.stop_token_ids or ()) + stop_ids)


# ---- sampling ----------------------------------------------------------------------------------------------
async def _sample_all(engine: Engine, tokenizer, jobs: list[tuple[list[int], SamplingParams]],
                      body: _Body) -> list[Choice]:
    """Sample every (prompt, params) job concurrently; the first failure cancels the rest and is raised."""
    if body.stops:
        _need_tokenizer(tokenizer, "stop")
    for prompt, sampling in jobs:  # refuse before anything is submitted
        engine.validate(prompt, sampling, "check")
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_sample(engine, tokenizer, p, s, body.stops, body.skip_special_tokens))
                     for p, s in jobs]
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    return [t.result() for t in tasks]


async def _sample(engine: Engine, tokenizer, prompt: list[int], sampling: SamplingParams, stops: list[str],
                  skip_special: bool) -> Choice:
    """One completion: continued after abort-mode pauses, then cut where a stop string is complete."""
    out = None
    while True:
        done = out.output_ids if out else []
        step = await engine.generate(prompt + done, dataclasses.replace(
            sampling, max_new_tokens=sampling.max_new_tokens - len(done)))
        out = step if out is None else dataclasses.replace(
            step, output_ids=done + step.output_ids, output_logprobs=out.output_logprobs + step.output_logprobs,
            weight_versions=out.weight_versions + step.weight_versions, prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens)
        if step.finish_reason.type != "abort" or len(out.output_ids) >= sampling.max_new_tokens:
            break
        if step.finish_reason.message != PAUSED_ABORT:
            raise OpenAIError(f"the engine aborted the request: {step.finish_reason.message}", status=500)
    if out.finish_reason.type == "abort":
        out = dataclasses.replace(out, finish_reason=FinishReason("length", length=len(out.output_ids)))
    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special)) if tokenizer else (lambda _: "")
    choice = Choice(prompt, out, decode(out.output_ids), out.finish_reason.type)
    if stops and any(s in choice.text for s in stops):
        _cut_at_stop(choice, stops, decode)
    return choice


def _cut_at_stop(choice: Choice, stops: list[str], decode) -> None:
    """Cut `choice` after the first token whose text completes a stop string (a binary search over prefixes),
    its text before that string."""
    ids = choice.out.output_ids
    lo, hi = 1, len(ids)  # the shortest prefix whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    text = decode(ids[:lo])
    stop = min((s for s in stops if s in text), key=text.index)
    out = choice.out
    choice.out = dataclasses.replace(out, output_ids=ids[:lo], output_logprobs=out.output_logprobs[:lo],
                                     weight_versions=out.weight_versions[:lo],
                                     finish_reason=FinishReason("stop"))
    choice.text, choice.finish, choice.stop = text[:text.index(stop)], "stop", stop


# ---- replies -----------------------------------------------------------------------------------------------
def _reply(prefix: str, kind: str, model_id: str, choices: list[Choice]) -> dict:
    prompt_tokens = sum(len(p) for p in {tuple(c.prompt_ids) for c in choices})
    completion_tokens = sum(len(c.out.output_ids) for c in choices)
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model_id,
            "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                     "total_tokens": prompt_tokens + completion_tokens}}


def _token_texts(ids: list[int], tokenizer) -> list[str]:
    return [tokenizer.decode([t]) for t in ids] if tokenizer else [f"token_id:{t}" for t in ids]


def _exact(c: Choice) -> dict:
    return {"prompt_token_ids": c.prompt_ids, "token_ids": c.out.output_ids, "meta_info": c.meta_info()}


def _chat_choice(i: int, c: Choice, body: ChatBody, tokenizer) -> dict:
    content, calls = chat.parse_tool_calls(c.text) if body.tools and body.tool_choice != "none" else (c.text, [])
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    logprobs = None
    if body.logprobs:
        logprobs = {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                                for s, lp in zip(_token_texts(c.out.output_ids, tokenizer), c.out.output_logprobs,
                                                 strict=True)]}
    finish = "tool_calls" if calls and c.finish == "stop" else c.finish
    return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish, **_exact(c)}


def _completion_choice(i: int, c: Choice, body: CompletionBody, tokenizer) -> dict:
    logprobs = None
    if body.logprobs is not None:
        tokens = _token_texts(c.out.output_ids, tokenizer)
        offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
        logprobs = {"tokens": tokens, "token_logprobs": c.out.output_logprobs, "top_logprobs": None,
                    "text_offset": offsets}
    return {"index": i, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish, **_exact(c)}


async def _chat_chunks(reply: dict, body: ChatBody) -> AsyncIterator[dict]:
    """A chat reply as OpenAI's chunks: per choice its role, its content, its tool calls, its finish; then the
    usage when asked for. `token_ids` ride with the content, `prompt_token_ids` with the first chunk."""
    head = {k: reply[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    for choice in reply["choices"]:
        i, message = choice["index"], choice["message"]
        yield head | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None, "prompt_token_ids": choice["prompt_token_ids"]}]}
        if message["content"] or choice["token_ids"]:
            yield head | {"choices": [{"index": i, "delta": {"content": message["content"] or ""},
                                       "logprobs": choice["logprobs"], "finish_reason": None,
                                       "token_ids": choice["token_ids"]}]}
        if message.get("tool_calls"):
            calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            yield head | {"choices": [{"index": i, "delta": {"tool_calls": calls}, "finish_reason": None}]}
        yield head | {"choices": [{"index": i, "delta": {}, "finish_reason": choice["finish_reason"],
                                   "meta_info": choice["meta_info"]}]}
    if body.stream_options and body.stream_options.include_usage:
        yield head | {"choices": [], "usage": reply["usage"], **({"session": reply["session"]}
                                                                  if "session" in reply else {})}


async def _completion_chunks(reply: dict, choices: list[Choice], body: CompletionBody,
                             tokenizer) -> AsyncIterator[dict]:
    head = {k: reply[k] for k in ("id", "created", "model")} | {"object": "text_completion"}
    for i, c in enumerate(choices):
        full = _completion_choice(i, c, body, tokenizer)
        yield head | {"choices": [{**full, "finish_reason": None, "meta_info": None}]}
        yield head | {"choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": c.finish,
                                   "meta_info": full["meta_info"]}]}
    if body.stream_options and body.stream_options.include_usage:
        yield head | {"choices": [], "usage": reply["usage"]}


def _stream(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events():
        async for chunk in chunks:
            yield b"data: " + pydantic_core.to_json(chunk, inf_nan_mode="null") + b"\n\n"
        yield b"data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


def _json(content, status_code: int = 200) -> Response:
    return Response(pydantic_core.to_json(content, inf_nan_mode="null"), status_code, media_type="application/json")

