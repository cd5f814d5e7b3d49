"""`/generate`'s requests and replies: a body turned into engine requests (`jobs_of`: a batch's elements, `n`
samples each, every one checked before any is submitted), run together (`generate_all`) or streamed as SGLang's
server-sent events (`events`), each reply shaped as SGLang's (`output`). The wire format is stated in
`tandem.server.http`; text (stop strings, decoding) in `tandem.server.text`."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator

import pydantic_core
import torch
from fastapi import Request

from tandem.engine.engine import Engine, EngineError
from tandem.server import disagg, text
from tandem.server.bodies import GenerateBody
from tandem.server.text import check_text, token_texts
from tandem.types import GenerateOutput, SamplingParams

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.05


# ---- /generate ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """One request of a /generate body (a batch's element, one of `n` samples)."""

    input_ids: list[int]
    sampling: SamplingParams
    rid: str
    routed: bool = False  # return its routed experts
    logprobs: bool = False  # return its logprobs


def jobs_of(body: GenerateBody, engine: Engine) -> tuple[list[Job], bool]:
    """The requests of a /generate body, each checked by the engine; returns (jobs, is_batch). A prompt whose
    sampling params ask for `n` > 1 samples is `n` requests in a row (as SGLang orders them: prompt by prompt), rids
    `<rid>_<j>` when given, seeds `seed + j` when set (n copies of one seeded sample would be one sample). Raises
    ValueError naming the field (with the batch index, e.g. `input_ids[2][5]`); submits nothing."""
    prompts, is_batch = _prompts(body, engine.tokenizer)
    n = len(prompts)
    rids = body.rid
    if rids is None:
        rids = [None] * n
    elif not is_batch:
        rids = [rids]
    elif not isinstance(rids, list) or len(rids) != n:
        raise ValueError(f"rid: a batch of {n} requests needs a list of {n} rids")
    sampling = body.sampling_params
    if is_batch and isinstance(sampling, list):
        if len(sampling) != n:
            raise ValueError(f"sampling_params: a batch of {n} requests needs one object or a list of {n}")
        params = [_sampling_params(d, f"sampling_params[{i}]") for i, d in enumerate(sampling)]
    else:
        params = [_sampling_params(sampling, "sampling_params")] * n
    top = body.top_logprobs_num or 0
    params = [dataclasses.replace(sp, top_logprobs_num=top) if top else sp for sp in params]
    routed = _flags(body.return_routed_experts, n, "return_routed_experts")
    logprobs = _flags(body.return_logprob, n, "return_logprob")
    for i, sp in enumerate(params):
        check_text(sp, engine.tokenizer, f"sampling_params[{i}]" if is_batch else "sampling_params")
    if top and body.bootstrap is not None:
        raise ValueError("top_logprobs_num: a decode server does not return top logprobs yet; send 0 or null")

    jobs = []
    for i, (ids, sp, rid) in enumerate(zip(prompts, params, rids, strict=True)):
        try:
            engine.validate(ids, sp, rid or "x")
        except ValueError as e:
            raise ValueError(_at_index(str(e), i) if is_batch else str(e)) from None
        for j in range(sp.n):
            sample = dataclasses.replace(sp, n=1, seed=None if sp.seed is None else (sp.seed + j) % 2**63)
            name = rid if sp.n == 1 else (f"{rid}_{j}" if rid is not None else None)
            jobs.append(Job(ids, sample, name or uuid.uuid4().hex, routed[i], logprobs[i]))
    is_batch = is_batch or len(jobs) > 1
    limit = engine.config.max_batch_requests
    if len(jobs) > limit:
        raise ValueError(f"input_ids: a batch of {len(jobs)} requests (prompts times n) exceeds max_batch_requests "
                         f"({limit})")
    names = [job.rid for job in jobs]
    if len(set(names)) != len(names):
        dup = next(r for r in names if names.count(r) > 1)
        raise ValueError(f"rid: {dup!r} appears more than once in the batch")
    return jobs, is_batch


def _prompts(body: GenerateBody, tokenizer) -> tuple[list, bool]:
    """The body's prompts as token ids (`text` encoded by the tokenizer), and whether it is a batch."""
    if body.text is not None:
        if body.input_ids is not None:
            raise ValueError("text: send text or input_ids, not both")
        if tokenizer is None:
            raise ValueError("text: this model directory has no tokenizer, so the server takes token ids only; "
                             "send input_ids")
        texts = body.text if isinstance(body.text, list) else [body.text]
        if not texts:
            raise ValueError("text: must be a string, or a non-empty list of strings")
        return [tokenizer.encode(t) for t in texts], isinstance(body.text, list)
    ids = body.input_ids
    if ids is None:
        raise ValueError("input_ids: required (or text, when the model directory has a tokenizer)")
    is_batch = len(ids) > 0 and isinstance(ids[0], list)
    return (ids if is_batch else [ids]), is_batch


def _sampling_params(d, name: str) -> SamplingParams:
    try:
        return SamplingParams.from_dict(d)
    except ValueError as e:
        raise ValueError(str(e).replace("sampling_params", name, 1)) from None


def _at_index(message: str, i: int) -> str:
    """`input_ids[5]: ...` -> `input_ids[2][5]: ...` for element 2 of a batch (likewise rid, sampling_params)."""
    for field in ("input_ids", "rid", "sampling_params"):
        if message.startswith(field):
            return f"{field}[{i}]{message[len(field):]}"
    return f"input_ids[{i}]: {message}"


def _flags(value: bool | list[bool] | None, n: int, name: str) -> list[bool]:
    """A per-request boolean of a /generate body: one for all, or a list of one per request of a batch."""
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name}: a batch of {n} requests needs one boolean or a list of {n}")
        return value
    return [bool(value)] * n


def submitter(engine: Engine, prefill: disagg.PrefillClient | None, bootstrap, job: Job):
    """The awaitable that submits `job` to the engine: directly, or on a decode server through the prefill server
    its `bootstrap` names."""
    if bootstrap is None:
        return engine.generate(job.input_ids, job.sampling, job.rid, return_routed_experts=job.routed)

    async def through_prefill():
        url = bootstrap.prefill_url.rstrip("/")
        return (await prefill.generate_all([(job.input_ids, job.sampling, job.rid)], url, [job.routed]))[0]

    return through_prefill()


async def generate_all(engine: Engine, jobs: list[Job], submit) -> list[GenerateOutput]:
    """Run the jobs concurrently (`tandem.server.text.generate`: stop strings, text), outputs in order. If one
    fails, the others are cancelled (which aborts them in the engine) and its error is raised. Cancelling this
    coroutine aborts them all."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(text.generate(engine, job.input_ids, job.sampling, job.rid, submit(job),
                                                     engine.tokenizer)) for job in jobs]
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    return [t.result() for t in tasks]


async def events(request: Request, engine: Engine, jobs: list[Job], is_batch: bool, body: GenerateBody, submit,
                  inflight: set[str]) -> AsyncIterator[bytes]:
    """A streamed /generate as SGLang sends it: a server-sent event `data: {...}` per step that sampled tokens for a
    request, each chunk its whole output so far (`text`, `output_ids`, `meta_info` with `finish_reason` null until
    the last chunk; a batch's chunks also carry the request's `index`), then `data: [DONE]`. An error once streaming
    has begun is a chunk `{"error": {...}}` before `[DONE]`. A client that goes away aborts its requests."""
    rids = [job.rid for job in jobs]
    if clash := inflight.intersection(rids):
        yield _event({"error": {"message": f"rid: {sorted(clash)[0]!r} is already in flight", "type": "BadRequest"}})
        yield DONE
        return
    inflight.update(rids)
    chunks: asyncio.Queue = asyncio.Queue()

    async def one(i: int, job: Job):
        async for out in text.generate_stream(engine, job.input_ids, job.sampling, job.rid, submit(job),
                                              engine.tokenizer):
            chunk = output(out, job, body, engine.tokenizer)
            if is_batch:
                chunk["index"] = i
            await chunks.put(_event(chunk))  # (serialised now: a progress's lists grow with the next step)

    async def run_all():
        try:
            async with asyncio.TaskGroup() as group:
                for i, job in enumerate(jobs):
                    group.create_task(one(i, job))
        except BaseExceptionGroup as eg:
            error = eg.exceptions[0]
            log.warning("/generate stream failed: %s", error)
            await chunks.put(_event({"error": {"message": str(error), "type": "BadRequest" if isinstance(
                error, ValueError | EngineError) else "InternalServerError"}}))
        await chunks.put(None)

    runner = asyncio.ensure_future(run_all())
    try:
        while (chunk := await unless_disconnected(request, chunks.get())) is not None:
            yield chunk
        yield DONE
    finally:
        inflight.difference_update(rids)
        if not runner.done():
            runner.cancel()  # (each stream aborts its request)
            await asyncio.wait([runner])


DONE = b"data: [DONE]\n\n"


def _event(chunk: dict) -> bytes:
    return b"data: " + pydantic_core.to_json(chunk, inf_nan_mode="null") + b"\n\n"


async def unless_disconnected(request: Request, coro):
    """Await `coro`, polling the connection; if the client goes away first, cancel it and return None."""
    task = asyncio.ensure_future(coro)
    try:
        while not task.done():
            await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                log.info("client disconnected; aborting its request(s)")
                return None
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait([task])  # let `engine.generate` send its abort before we move on


def output(out: GenerateOutput, job: Job, body: GenerateBody, tokenizer) -> dict:
    """One request's reply as SGLang shapes it: `text`, `output_ids`, `meta_info`."""
    texts = tops = None
    if job.logprobs and body.return_text_in_logprobs and tokenizer is not None:
        texts = token_texts(tokenizer, out.output_ids)
        if out.output_top_logprobs is not None:
            tops = [token_texts(tokenizer, [t for _, t in top]) for top in out.output_top_logprobs]
    meta = out.meta_info(job.logprobs, texts, tops)
    if out.routed_experts is not None:  # SGLang's form: base64 of the int32 array [tokens - 1, layers, top-k]
        meta["routed_experts"] = base64.b64encode(out.routed_experts.to(torch.int32).numpy().tobytes()).decode()
    return {"text": out.text, "output_ids": out.output_ids, "meta_info": meta}
