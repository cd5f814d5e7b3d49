"""Prefill/decode disaggregation between `tandem serve --role prefill` and `--role decode` servers, over HTTP.

The protocol is tandem's own (SGLang pairs its servers through a bootstrap port and moves KV by RDMA):
- `GET /pd/info` on every server: its role, KV layout (page size, dtype, layers, KV heads, head dim), model config
  and weight version (`kv_layout`).
- A decode server's `/generate` may carry `bootstrap: {"prefill_url": URL}` (a router adds it). For each prompt
  the decode server then goes through these states:
  bootstrapping: it pairs with URL once (`/pd/info`; any difference in layout, model or weight version refuses the
  pairing with a message naming the field) and asks its engine which leading whole pages of the prompt it already
  holds (`Engine.probe`, which also makes the engine expect the import);
  waiting: it POSTs `/pd/prefill` (the prompt, the sampling parameters with the seed it chose, `kv_from`) and the
  prefill server computes the prompt and samples the first token;
  transferring: the answer's body is the KV of positions [kv_from, prompt length) (`KVPages` bytes, a checksum per
  page) and its header the first token, logprob and weight version;
  done: the engine imports both (`Engine.generate_imported`) and decodes on;
  failed: the prefill server was unreachable, failed, timed out or sent bytes that do not verify: the request ends
  with an abort naming the server and the cause, and the engine forgets it (nothing was written into its pool).
A pause on the decode server holds imports that arrive during it (nothing is written until it continues); a pause in
mode abort ends them, as it ends running requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import uuid

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import Response

from tandem.engine.engine import Engine
from tandem.engine.kv_transfer import KVPages, wire_meta
from tandem.server.bodies import PrefillBody
from tandem.types import HANDED_BACK, FinishReason, GenerateOutput, SamplingParams

HEADER = "X-Tandem-Prefill"
PREFILL_TIMEOUT_S = 300.0  # a prefill server that has not answered a prompt by then has failed it


def kv_layout(engine: Engine, role: str | None = None) -> dict:
    """What a decode server and its prefill server must agree on, and the role (`role`, or the engine's)."""
    pool = engine.pool
    return {"role": role or engine.config.role, "page_size": pool.page_size,
            "kv_dtype": str(pool.k_cache.dtype).removeprefix("torch."),
            "num_layers": pool.k_cache.shape[0], "num_kv_heads": pool.k_cache.shape[2],
            "head_dim": pool.k_cache.shape[3], "model": dataclasses.asdict(engine.model_config),
            "weight_version": engine.weight_version}


def add_routes(app: FastAPI, engine: Engine, until_disconnected) -> None:
    """`/pd/info` on every server; `/pd/prefill` on a prefill server (`until_disconnected(request, coro)`: the
    server's way of aborting a request whose client went away)."""

    @app.get("/pd/info")
    async def info():
        return kv_layout(engine)

    if engine.config.role != "prefill":
        return

    @app.post("/pd/prefill")
    async def prefill(request: Request):
        body = await PrefillBody.from_request(request)
        generated = len(body.input_ids) - (body.prompt_len or len(body.input_ids))  # (before a hand-back)
        sampling = dataclasses.replace(SamplingParams.from_dict(body.sampling_params), max_new_tokens=generated + 1)
        if sampling.seed is None:
            raise ValueError("sampling_params.seed: required (the decode server samples on with it)")
        rid = f"{body.rid}/prefill-{uuid.uuid4().hex[:8]}"
        engine.validate(body.input_ids, sampling, rid)
        out = await until_disconnected(request, engine.generate(body.input_ids, sampling, rid, body.kv_from,
                                                                body.prompt_len))
        if out is None:
            return Response(status_code=499)
        sampled = out.output_logprobs  # (only the token it sampled: the earlier ones are the decode server's)
        first = [out.output_ids[-1], sampled[-1], out.weight_versions[-1]] if sampled else None
        meta = {"first": first, "finish_reason": out.finish_reason.to_dict(), "cached_tokens": out.cached_tokens,
                "prefill_tokens": out.prefill_tokens}
        return Response(out.kv.to_bytes() if out.kv is not None else b"", media_type="application/octet-stream",
                        headers={HEADER: json.dumps(meta)})


class PrefillClient:
    """A decode server's way through prefill servers (see the module docstring)."""

    def __init__(self, engine: Engine, timeout_s: float = PREFILL_TIMEOUT_S):
        self.engine, self.timeout_s = engine, timeout_s
        self.paired: set[str] = set()
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def pair(self, url: str) -> None:
        """Check once that `url` is a prefill server this one can take KV from; ValueError naming what differs."""
        if url in self.paired:
            return
        try:
            async with self._http().get(f"{url}/pd/info") as r:
                if r.status != 200:
                    raise ValueError(f"bootstrap.prefill_url: {url}/pd/info answered {r.status}")
                theirs = await r.json()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ValueError(f"bootstrap.prefill_url: {url} is unreachable ({type(e).__name__}: {e})") from None
        mine = json.loads(json.dumps(kv_layout(self.engine, "prefill")))  # (as JSON gives it: lists, not tuples)
        mine |= {f"model.{k}": v for k, v in mine.pop("model").items()}
        theirs |= {f"model.{k}": v for k, v in (theirs.pop("model", None) or {}).items()}
        for key, value in mine.items():
            if theirs.get(key) != value:
                raise ValueError(f"bootstrap.prefill_url: {url} cannot pair with this decode server: its {key} is "
                                 f"{theirs.get(key)!r}, this server's {value!r}")
        self.paired.add(url)

    async def generate_all(self, jobs: list[tuple[list[int], SamplingParams, str]], url: str) -> list[GenerateOutput]:
        """Each job (input ids, sampling, rid) through the prefill server at `url`, concurrently, outputs in order.
        Cancelling this coroutine aborts them all."""
        await self.pair(url)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._one(*job, url)) for job in jobs]
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from None
        return [t.result() for t in tasks]

    async def _one(self, input_ids: list[int], sampling: SamplingParams, rid: str, url: str) -> GenerateOutput:
        """One request through `url`, again after each hand-back (`HANDED_BACK`: its prompt and what it generated
        so far computed there under the weights held now)."""
        if sampling.seed is None:  # the prefill server samples the first token, this engine the rest: one seed
            sampling = dataclasses.replace(sampling, seed=random.getrandbits(63))
        so_far = GenerateOutput(rid, [], [], [], FinishReason("abort", message=HANDED_BACK), len(input_ids), 0)
        prefilled = retractions = 0
        while so_far.finish_reason.message == HANDED_BACK:
            history = input_ids + so_far.output_ids
            kv_from = await self.engine.probe(history, rid)
            try:
                sampled, kv, meta = await self._prefill(url, history, sampling, rid, kv_from, len(input_ids))
            except BaseException as e:
                self.engine.abort(rid)  # it expected the import: forget it
                if isinstance(e, asyncio.CancelledError):
                    raise
                message = f"prefill server {url} failed: {type(e).__name__}: {e}"
                return dataclasses.replace(so_far, finish_reason=FinishReason("abort", message=message))
            if not prefilled:  # what the prompt cost: the prefill server's cache hits
                so_far.cached_tokens = meta["cached_tokens"]
            prefilled += meta["prefill_tokens"]
            if sampled is None:  # the prefill server ended it (an abort there: a pause, a flush)
                self.engine.abort(rid)
                return dataclasses.replace(so_far, finish_reason=FinishReason(**meta["finish_reason"]))
            generated = [[*mine, theirs] for mine, theirs in zip(
                (so_far.output_ids, so_far.output_logprobs, so_far.weight_versions), sampled, strict=True)]
            out = await self.engine.generate_imported(input_ids, sampling, tuple(generated), kv, rid)
            retractions += out.finish_reason.message == HANDED_BACK
            so_far = dataclasses.replace(out, cached_tokens=so_far.cached_tokens)
        so_far.prefill_tokens, so_far.num_retractions = prefilled, so_far.num_retractions + retractions
        return so_far

    async def _prefill(self, url, input_ids, sampling, rid, kv_from, prompt_len):
        body = {"rid": rid, "input_ids": input_ids, "sampling_params": dataclasses.asdict(sampling), "kv_from": kv_from,
                "prompt_len": prompt_len}
        async with self._http().post(f"{url}/pd/prefill", json=body) as r:
            data = await r.read()
            if r.status != 200:
                raise RuntimeError(f"answered {r.status}: {data[:300].decode(errors='replace')}")
            meta = json.loads(r.headers[HEADER])
        if meta["first"] is None:
            return None, None, meta
        kv = KVPages.from_bytes(data, wire_meta(data))
        if kv.start != kv_from or kv.end != len(input_ids):
            raise ValueError(f"sent positions [{kv.start}, {kv.end}), asked for [{kv_from}, {len(input_ids)})")
        kv.verify()
        return meta["first"], kv, meta
