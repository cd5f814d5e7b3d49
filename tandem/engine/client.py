"""An engine behind its HTTP server (tandem's or SGLang's field names), with the async methods of `Engine` that the
rollout manager and the run loop use: generate, pause, resume, get_stats, and the weight-update calls.

Errors: a 400 (the engine refused the request: bad input, or not allowed in its state) raises ValueError with the
engine's message; another error status raises `EngineClientError`; no answer (refused or broken connection, a
timeout, or a router's 502/503/504: the server behind it did not answer) raises `EngineUnreachable`. Every message
names the engine's URL and the endpoint. A generate has no read timeout (it takes as long as its tokens take): an
engine that dies breaks its connection, which fails it at once, and one that stalls is the business of a health
monitor (`tandem.run.placement`). Every other call is bounded by `timeout_s`.

The client is aiohttp's: a run keeps one generate open per episode in flight (hundreds), and its connection pool
costs the same per request however many are open (httpcore's scans every pooled connection on every request and
reply, in the event loop the rollout shares with the trainer).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import urllib.error
import urllib.parse
import urllib.request

import aiohttp
import pydantic_core

from tandem.config import ModelConfig
from tandem.transport.sync import SyncReply
from tandem.types import EngineStats, FinishReason, GenerateOutput, SamplingParams

JSON_HEADERS = {"Content-Type": "application/json"}
# An idle pooled connection is closed by the client after this long, before any server would close it (tandem's
# keep theirs `tandem.server.http.KEEP_ALIVE_S`; uvicorn's default, which SGLang's and vLLM's servers run with, is 5
# s): a request sent on a connection the server is closing fails (aiohttp retries no POST), and a client whose event
# loop was busy (a trainer's step) has not yet seen the server's close. Opening a connection again costs far less.
IDLE_CLOSE_S = 4.0


class EngineClientError(RuntimeError):
    """The engine answered with an error status other than 400."""


class EngineUnreachable(EngineClientError):
    """The engine did not answer: its connection was refused or broke, or the call timed out."""


class EngineClient:
    """`connect` reads the model's config, context length and weight version (blocking, at most `timeout_s`).
    `weight_version` is then the version of the last update made through this client, which is the engine's own as
    long as this client is the only one updating it (as in a run, where the trainer owns the engine)."""

    def __init__(self, url: str, timeout_s: float = 300.0, api_key: str | None = None,
                 idle_close_s: float = IDLE_CLOSE_S):
        """`api_key`: sent as `Authorization: Bearer` (the server's admin key, for a run that updates weights).
        `idle_close_s`: see `IDLE_CLOSE_S`."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be positive, got {timeout_s!r}")
        self.url, self.timeout_s, self.idle_close_s = url.rstrip("/"), timeout_s, idle_close_s
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model_config: ModelConfig | None = None
        self.max_context_len = 0
        self.weight_version = 0
        self._http: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def connect(self) -> EngineClient:
        what = "GET /get_model_info"
        try:
            request = urllib.request.Request(f"{self.url}/get_model_info", headers=self._auth)
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                info = self._check(what, reply.status, reply.read())
        except urllib.error.HTTPError as e:  # an error status
            info = self._check(what, e.code, e.read())
        except (urllib.error.URLError, OSError) as e:  # no answer
            raise self._unreachable(what, e) from e
        names = {f.name for f in dataclasses.fields(ModelConfig)}
        self.model_config = ModelConfig(**{k: v for k, v in info.items() if k in names})
        self.max_context_len, self.weight_version = info["context_length"], info["weight_version"]
        return self

    # ---- the Engine API ----------------------------------------------------------------------------------------
    async def generate(self, input_ids: list[int], sampling: SamplingParams | None = None,
                       rid: str | None = None, return_routed_experts: bool = False) -> GenerateOutput:
        """One request, SGLang's `/generate` with `return_logprob` (and `return_routed_experts`: the output's
        `routed_experts` as the in-process engine gives them). Cancelling it closes the connection, which aborts the
        request in the engine."""
        body = {"input_ids": list(input_ids), "return_logprob": True,
                "sampling_params": dataclasses.asdict(sampling or SamplingParams())}
        if rid is not None:
            body["rid"] = rid
        if return_routed_experts:
            body["return_routed_experts"] = True
        return parse_output(await self._request("POST", "/generate", body, None), self.model_config)

    async def pause(self, mode: str = "abort") -> None:
        await self._post("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._post("/continue_generation", {})

    async def get_stats(self) -> EngineStats:
        return EngineStats(**await self._request("GET", "/engine_stats", None, self.timeout_s))

    async def health(self, timeout_s: float) -> bool:
        """Whether the engine answers `/health` (its loop responsive) within `timeout_s`."""
        try:
            await self._request("GET", "/health", None, timeout_s)
        except EngineClientError:
            return False
        return True

    # ---- weight updates over a torch.distributed group (SGLang's endpoints) ------------------------------------
    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str, timeout_s: float) -> None:
        """Have the engine join the weight group as rank `rank_offset`; returns once every rank has joined (the
        trainer must build its `DistSender` meanwhile). `timeout_s` bounds every collective of the group."""
        await self._post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend, "timeout_s": timeout_s})

    async def update_weights_from_distributed(self, group_name: str, weight_version: int,
                                              pause_mode: str) -> SyncReply:
        """Have the engine receive one transfer from the group's sender (which must send meanwhile) and load it
        as `weight_version`, pausing with `pause_mode` only to load. Returns the engine's reply."""
        reply = SyncReply.from_dict(await self._post("/update_weights_from_distributed", {
            "group_name": group_name, "weight_version": weight_version, "pause_mode": pause_mode}))
        self.weight_version = reply.weight_version
        return reply

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._post("/destroy_weights_update_group", {"group_name": group_name})

    # ---- a router's replicas (SGLang router's endpoints) ----------------------------------------------------------
    async def add_worker(self, url: str, weight_version: int | None = None) -> None:
        """Have the router put the server at `url` into rotation (refused, ValueError, unless it holds the weights
        of those in rotation, and `weight_version` if given)."""
        query = {"url": url} | ({} if weight_version is None else {"weight_version": weight_version})
        await self._post(f"/add_worker?{urllib.parse.urlencode(query)}", {})

    async def remove_worker(self, url: str) -> None:
        await self._post(f"/remove_worker?{urllib.parse.urlencode({'url': url})}", {})

    # ---- plumbing ----------------------------------------------------------------------------------------------
    async def _post(self, path: str, body: dict) -> dict:
        return await self._request("POST", path, body, self.timeout_s)

    async def _request(self, method: str, path: str, body: dict | None, timeout_s: float | None) -> dict:
        """`timeout_s` bounds each read (None: unbounded); connecting is always bounded by `self.timeout_s`."""
        what = f"{method} {path}"
        timeout = aiohttp.ClientTimeout(sock_connect=self.timeout_s, sock_read=timeout_s)
        try:
            data = None if body is None else pydantic_core.to_json(body)  # (Rust: see tandem.server.http._json)
            headers = {**JSON_HEADERS, **self._auth} if data is not None else self._auth
            async with self._client().request(method, self.url + path, data=data, timeout=timeout,
                                              headers=headers) as reply:
                status, content = reply.status, await reply.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise self._unreachable(what, e) from e
        return self._check(what, status, content)

    def _unreachable(self, what: str, e: Exception) -> EngineUnreachable:
        return EngineUnreachable(f"engine at {self.url}: {what}: {type(e).__name__}: {str(e) or 'no answer'}")

    def _check(self, what: str, status: int, content: bytes) -> dict:
        if status == 200:
            return pydantic_core.from_json(content) if content else {}
        try:
            message = pydantic_core.from_json(content)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = content[:500].decode(errors="replace")
        if status == 400:
            raise ValueError(f"engine at {self.url}: {what}: {message}")
        if status in (502, 503, 504):  # a router's: the server behind it did not answer
            raise EngineUnreachable(f"engine at {self.url}: {what}: HTTP {status}: {message}")
        raise EngineClientError(f"engine at {self.url}: {what}: HTTP {status}: {message}")

    def _client(self) -> aiohttp.ClientSession:
        """One connection pool per event loop (a pool's connections belong to the loop that opened them)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:
            # no connection limit: every episode in flight holds a generate open
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.idle_close_s)
            self._http = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout())
            self._loop = loop
        return self._http

    async def aclose(self) -> None:
        if self._http is not None and self._loop is asyncio.get_running_loop():
            await self._http.close()
        self._http = self._loop = None


def parse_output(d: dict, model: ModelConfig | None = None) -> GenerateOutput:
    """A `GenerateOutput` from one element of SGLang's `/generate` reply (with `output_token_logprobs`). Its
    `meta_info.routed_experts` (base64 of int32) becomes the int16 tensor [rows, layers, k] of `model`'s shape."""
    meta = d["meta_info"]
    routed = None
    if meta.get("routed_experts") is not None:
        if model is None:
            raise ValueError("routed_experts: reading them needs the model's config (its layers and top-k)")
        import torch  # (only here: the client is otherwise free of it)

        raw = bytearray(base64.b64decode(meta["routed_experts"]))
        routed = torch.frombuffer(raw, dtype=torch.int32) if raw else torch.zeros(0, dtype=torch.int32)
        routed = routed.view(-1, model.num_hidden_layers, model.num_experts_per_tok).to(torch.int16)
    reason = meta["finish_reason"]
    logprobs = [lp for lp, _, _ in meta.get("output_token_logprobs", [])]
    return GenerateOutput(
        rid=meta["id"], output_ids=d["output_ids"], output_logprobs=logprobs,
        weight_versions=meta.get("output_token_weight_versions", [meta.get("weight_version", 0)] * len(logprobs)),
        finish_reason=FinishReason(reason["type"], reason.get("length"), reason.get("matched"), reason.get("message")),
        prompt_tokens=meta["prompt_tokens"], cached_tokens=meta["cached_tokens"],
        host_cached_tokens=meta.get("cached_tokens_details", {}).get("host", 0),
        prefill_tokens=meta.get("prefill_tokens", 0),
        weight_version=meta.get("weight_version", 0), routed_experts=routed)
