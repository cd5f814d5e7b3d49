"""OpenAI-compatible endpoints, and session-scoped chat with exact token histories.

Routes: `GET /v1/models`; `POST /v1/completions`, `/v1/chat/completions` (bodies: `tandem.server.openai_bodies`),
with `stream` (server-sent events of OpenAI's chunks as the tokens are sampled, then `data: [DONE]`), `n`, `seed`
(choice j samples with seed + j), `stop` (strings, `tandem.server.text`: they end the request; `stop_token_ids`
too), `logprobs` and `top_logprobs` (completions: `logprobs` = the number of top logprobs), `max_tokens` /
`max_completion_tokens` (default: what the context leaves), `tools` (rendered by the model's chat template;
`<tool_call>` JSON in the reply becomes `message.tool_calls`; in a stream the content then comes whole at the end).
Session-scoped chat (`tandem.server.sessions`): `POST /sessions/{id}/v1/chat/completions` (the same body, n = 1; a
stream is sent once the turn is complete), `GET /sessions/{id}` (its token history: ids, loss mask, logprobs,
weight versions), `DELETE /sessions/{id}`, `GET /sessions` (the store's counters: turns, reused, fallbacks...).

Exact tokens: every choice carries `prompt_token_ids`, `token_ids` and `meta_info` (`tandem.server.openai_replies`);
a session reply also carries `session` (`reused_tokens`, `appended_tokens`, `fallback`, `num_fallbacks`).

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (a chat or text
request to a server without a tokenizer too), 404 for an unknown session, 409 for a session busy with another
request; an error after a stream began is sent as an `error` event. A request cut short by an abort-mode pause is
continued from where it stopped (resubmitted with its output so far), as the rollout's agent loop does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tandem.engine.engine import Engine, EngineError
from tandem.server import chat, text
from tandem.server.generate import unless_disconnected
from tandem.server.openai_bodies import ChatBody, CompletionBody, OpenAIBody, OpenAIError
from tandem.server.openai_replies import Choice, Stream, chat_choice, completion_choice, head, usage
from tandem.server.sessions import SessionStore
from tandem.types import PAUSED_ABORT, FinishReason, GenerateOutput, SamplingParams

# where an engine's field names differ from OpenAI's
_PARAM = {"input_ids": "prompt", "sampling_params.max_new_tokens": "max_tokens",
          "sampling_params.top_logprobs_num": "top_logprobs"}


def add_routes(app: FastAPI, engine: Engine, sessions: SessionStore | None = None, tokenizer=None) -> None:
    """Add the OpenAI-compatible and session routes to `app`, serving `engine` with `tokenizer` (default:
    `engine.tokenizer`). `sessions`: the store of session histories (default: `SessionStore()`'s bounds); kept as
    `app.state.sessions`."""

    store = app.state.sessions = sessions or SessionStore()
    tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
    model_id = Path(tokenizer.name_or_path).name if tokenizer is not None else "tandem"

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "tandem",
                                            "max_model_len": engine.max_context_len}]}

    @app.post("/v1/completions")
    @_openai_errors
    async def completions(request: Request):
        body = await CompletionBody.from_request(request)
        prompts = _prompt_ids(body.prompt, tokenizer)
        jobs = [(p, _sampling(body, p, engine, j, (), body.logprobs or 0)) for p in prompts for j in range(body.n)]
        _check(engine, tokenizer, jobs)
        logprobs = body.logprobs is not None
        if body.stream:
            stream = Stream("text_completion", model_id, tokenizer, logprobs)
            return _stream(stream, _progress(engine, tokenizer, jobs), body.stream_options)
        choices = await unless_disconnected(request, _finished(engine, tokenizer, jobs))
        if choices is None:
            return Response(status_code=499)
        return _json(head("text_completion", model_id) | {
            "choices": [completion_choice(c, logprobs, tokenizer) for c in choices], "usage": usage(choices)})

    @app.post("/v1/chat/completions")
    @_openai_errors
    async def chat_completions(request: Request):
        body, messages, tools = await _chat_request(request, tokenizer)
        prompt = chat.encode(tokenizer, chat.render(tokenizer, messages, tools, body.chat_template_kwargs))
        jobs = _chat_jobs(body, [prompt] * body.n)
        if body.stream:
            stream = Stream("chat.completion.chunk", model_id, tokenizer, body.logprobs, hold_all=bool(tools))
            return _stream(stream, _progress(engine, tokenizer, jobs), body.stream_options)
        choices = await unless_disconnected(request, _finished(engine, tokenizer, jobs))
        if choices is None:
            return Response(status_code=499)
        return _json(_chat_reply(choices, body, tools))

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
            choices = await unless_disconnected(request, _finished(engine, tokenizer, _chat_jobs(body, [prompt.ids])))
            if choices is None:
                return Response(status_code=499)
            reply = _chat_reply(choices, body, tools)
            store.count_turn(prompt)
            session.record(prompt, messages, reply["choices"][0]["message"], tools, body.chat_template_kwargs,
                           choices[0].out)
        reply["session"] = {"id": session_id, "reused_tokens": prompt.reused,
                            "appended_tokens": len(prompt.ids) - prompt.reused, "fallback": prompt.fallback,
                            "num_fallbacks": session.num_fallbacks}
        if body.stream:  # (the turn is complete: its chunks at once)
            stream = Stream("chat.completion.chunk", model_id, tokenizer, body.logprobs, hold_all=bool(tools))
            return _stream(stream, _finished_one(choices[0]), body.stream_options, reply["session"])
        return _json(reply)

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

    def _chat_jobs(body: ChatBody, prompts: list[list[int]]) -> list[tuple[list[int], SamplingParams]]:
        """One job per choice; the end-of-turn token ends a reply (unless `ignore_eos`)."""
        stop_ids = () if body.ignore_eos else (tokenizer.eos_token_id,)
        tops = (body.top_logprobs or 0) if body.logprobs else 0
        jobs = [(p, _sampling(body, p, engine, j, stop_ids, tops)) for j, p in enumerate(prompts)]
        _check(engine, tokenizer, jobs)
        return jobs

    def _chat_reply(choices: list[Choice], body: ChatBody, tools) -> dict:
        return head("chat.completion", model_id) | {
            "choices": [chat_choice(c, bool(tools), body.logprobs, tokenizer) for c in choices],
            "usage": usage(choices)}


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
            return _json(_refusal(e).body(), 400)
    return wrapper


def _refusal(e: Exception) -> OpenAIError:
    message = str(e)
    field = message.split(":", 1)[0] if ":" in message and " " not in message.split(":", 1)[0] else None
    return OpenAIError(message, _PARAM.get(field, field.removeprefix("sampling_params.") if field else None))


def _need_tokenizer(tokenizer, what: str) -> None:
    if tokenizer is None:
        raise OpenAIError(f"{what} needs a tokenizer, and this server has none: serve a model directory holding "
                          "tokenizer.json and tokenizer_config.json", code="no_tokenizer")


async def _chat_request(request: Request, tokenizer) -> tuple[ChatBody, list[dict], list[dict] | None]:
    """The body, its messages normalised (`chat.normalize`) and its tools as the template takes them."""
    body = await ChatBody.from_request(request)
    _need_tokenizer(tokenizer, "chat")
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


def _sampling(body: OpenAIBody, prompt: list[int], engine: Engine, seed_offset: int, stop_ids: tuple,
              top_logprobs: int) -> SamplingParams:
    limit = body.token_limit if isinstance(body, ChatBody) else body.max_tokens
    if limit is None:
        limit = max(0, engine.max_context_len - len(prompt))
    seed = None if body.seed is None else (body.seed + seed_offset) % 2**63
    return SamplingParams(max_new_tokens=limit, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                          min_p=body.min_p, ignore_eos=body.ignore_eos, seed=seed,
                          stop_token_ids=tuple(body.stop_token_ids or ()) + stop_ids, stop=tuple(body.stops),
                          skip_special_tokens=body.skip_special_tokens, top_logprobs_num=top_logprobs)


def _check(engine: Engine, tokenizer, jobs: list[tuple[list[int], SamplingParams]]) -> None:
    """Refuse a request before anything of it is submitted (ValueError naming the field)."""
    for prompt, sampling in jobs:
        text.check_text(sampling, tokenizer)
        engine.validate(prompt, sampling, "check")


# ---- sampling ----------------------------------------------------------------------------------------------
async def _choice(engine: Engine, tokenizer, index: int, prompt: list[int], sampling: SamplingParams,
                  stream: bool) -> AsyncIterator[Choice]:
    """Yield a choice's progress (when `stream`: after each step that sampled its tokens), then the choice
    finished. A request cut short by an abort-mode pause is resubmitted with its output so far."""
    done: GenerateOutput | None = None
    while True:
        ids = done.output_ids if done else []
        left = dataclasses.replace(sampling, max_new_tokens=sampling.max_new_tokens - len(ids))
        if stream:
            async for out in text.generate_stream(engine, prompt + ids, left, uuid.uuid4().hex, tokenizer=tokenizer):
                out = _joined(done, out)
                if out.finish_reason is None:
                    yield Choice(index, prompt, out, sampling)
        else:
            out = _joined(done, await text.generate(engine, prompt + ids, left, uuid.uuid4().hex,
                                                    tokenizer=tokenizer))
        reason = out.finish_reason
        if reason.type != "abort" or len(out.output_ids) >= sampling.max_new_tokens:
            break
        if reason.message != PAUSED_ABORT:
            raise OpenAIError(f"the engine aborted the request: {reason.message}", status=500)
        done = out
    if done is not None:  # continued: the text (and a stop string across the seam) from the whole output
        matcher = text.OutputText(tokenizer, sampling)
        if (keep := matcher.feed(out.output_ids)) is not None:
            out = text.cut(out, keep, matcher.matched)
    if out.finish_reason.type == "abort":  # (paused as its last token was sampled)
        out = dataclasses.replace(out, finish_reason=FinishReason("length", length=len(out.output_ids)))
    out.text = text.final_text(tokenizer, out, sampling)
    yield Choice(index, prompt, out, sampling)


def _joined(done: GenerateOutput | None, out: GenerateOutput) -> GenerateOutput:
    """`out` of a resubmitted request after the output `done` of the requests before it."""
    if done is None:
        return out
    tops = None if done.output_top_logprobs is None or out.output_top_logprobs is None else \
        done.output_top_logprobs + out.output_top_logprobs
    return dataclasses.replace(out, output_ids=done.output_ids + out.output_ids,
                               output_logprobs=done.output_logprobs + out.output_logprobs,
                               weight_versions=done.weight_versions + out.weight_versions, output_top_logprobs=tops,
                               prompt_tokens=done.prompt_tokens, cached_tokens=done.cached_tokens,
                               text=done.text + out.text)


async def _finished(engine: Engine, tokenizer, jobs: list[tuple[list[int], SamplingParams]]) -> list[Choice]:
    """Every job's finished choice, sampled concurrently; the first failure cancels the rest and is raised."""
    async def last(index, prompt, sampling):
        return [c async for c in _choice(engine, tokenizer, index, prompt, sampling, stream=False)][-1]

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(last(i, p, s)) for i, (p, s) in enumerate(jobs)]
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    return [t.result() for t in tasks]


async def _progress(engine: Engine, tokenizer, jobs: list[tuple[list[int], SamplingParams]]) -> AsyncIterator[Choice]:
    """Every job's progress and finished choice as they come (choices interleaved). Closing it cancels the rest."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index, prompt, sampling):
        try:
            async for choice in _choice(engine, tokenizer, index, prompt, sampling, stream=True):
                queue.put_nowait(choice)
        except Exception as e:  # (sent to the reader; a cancellation is the reader's own)
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(i, p, s)) for i, (p, s) in enumerate(jobs)]
    try:
        finished = 0
        while finished < len(jobs):
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            finished += item.finished
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _finished_one(choice: Choice) -> AsyncIterator[Choice]:
    yield choice


# ---- replies -----------------------------------------------------------------------------------------------
def _stream(stream: Stream, choices: AsyncIterator[Choice], options, extra: dict | None = None) -> StreamingResponse:
    """Server-sent events: the chunks of each choice's progress, the usage when asked for, then `[DONE]`; an error
    once streaming has begun is an `error` event."""
    async def events():
        seen: dict[int, Choice] = {}
        try:
            async for choice in choices:
                seen[choice.index] = choice
                for chunk in stream.chunks(choice):
                    yield _event(chunk)
            if options and options.include_usage:
                yield _event(stream.usage_chunk(list(seen.values()), extra))
        except (OpenAIError, ValueError, EngineError) as e:
            yield _event((e if isinstance(e, OpenAIError) else _refusal(e)).body())
        yield b"data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


def _event(chunk: dict) -> bytes:
    return b"data: " + pydantic_core.to_json(chunk, inf_nan_mode="null") + b"\n\n"


def _json(content, status_code: int = 200) -> Response:
    return Response(pydantic_core.to_json(content, inf_nan_mode="null"), status_code, media_type="application/json")
