"""The engine's HTTP server: the subset of SGLang's native API that RL frameworks use, with SGLang's field names.

Endpoints: `POST /generate`, `/pause_generation`, `/continue_generation`, `/abort_request`, `/flush_cache`,
`/update_weights_from_disk`, `/init_weights_update_group`, `/update_weights_from_distributed`,
`/destroy_weights_update_group`; `GET /health`, `/get_model_info`, `/get_server_info`, `/metrics`, and tandem's
`/engine_stats` (the engine's counters as JSON). Under prefill/decode disaggregation (`EngineConfig.role`) also
`GET /pd/info` and, on a prefill server, `POST /pd/prefill`; a decode server's `/generate` takes `bootstrap`
(`tandem.server.disagg`).

Each route's JSON body is a pydantic model (`tandem.server.bodies`: unknown fields refused, JSON types strict); an
empty body is `{}`.

`/generate` speaks SGLang's `GenerateReqInput` whole as RL clients send it (null is the default): `input_ids`, or
`text` when the model directory has a tokenizer; every sampling field (`SamplingParams.from_dict`); `n` samples per
prompt; each reply `{"text", "output_ids", "meta_info"}` (a list for a batch or n > 1), `text` decoded by the
tokenizer ("" without one), stop strings and trimming as `tandem.server.text` states. `stream: true` answers with
server-sent events, SGLang's default (non-incremental) chunks: `data: {...}` per step that sampled tokens, each the
output so far (`finish_reason` null until the last), then `data: [DONE]`.

Contract: a malformed request or one the engine refuses in its state gets a 400 whose body is
`{"error": {"message": ..., "type": "BadRequest"}, "success": false, "message": ...}` (the shapes of SGLang's
generate and weight-update errors at once) and whose message names the field; nothing of it reaches the engine.
An unexpected exception is a 500 with its message, and the server keeps serving. A client that
disconnects while its `/generate` runs has its requests aborted in the engine, freeing their KV pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

import pydantic_core
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect

from tandem.engine.engine import Engine, EngineError
from tandem.model.loader import iter_safetensors
from tandem.server import disagg, openai_api
from tandem.server.bodies import (
    AbortBody,
    DiskUpdateBody,
    GenerateBody,
    GroupBody,
    GroupUpdateBody,
    InitGroupBody,
    NoBody,
    PauseBody,
)
from tandem.server.generate import events, generate_all, jobs_of, output, submitter, unless_disconnected
from tandem.server.guard import ADMIN, Guard, Refused, ServerOptions, TrackedSend
from tandem.server.metrics import MetricsExporter
from tandem.transport.dist import DistReceiver
from tandem.transport.sync import receive_and_load
from tandem.transport.weights import TransportError

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 4096  # beyond it new connections get a 503 (a flood of idle connections cannot take the server)
HEALTH_TIMEOUT_S = 5.0


def build_app(engine: Engine, options: ServerOptions | None = None) -> FastAPI:
    """A FastAPI app serving `engine` under `options` (keys, limits, weight directories: `tandem.server.guard`).
    The app owns a Prometheus registry of its own and the set of rids it has in flight (a rid may not be reused
    while in flight); the engine is shared, not owned (the caller shuts it down)."""
    options = options or ServerOptions()
    groups: dict[str, _WeightGroup | None] = {}  # None while joining

    prefill = disagg.PrefillClient(engine) if engine.config.role == "decode" else None

    @asynccontextmanager
    async def lifespan(app):
        yield
        for group in groups.values():
            if group is not None:
                group.receiver.close()
        if prefill is not None:
            await prefill.close()

    app = FastAPI(title="tandem engine", lifespan=lifespan)
    inflight: set[str] = set()
    exporter = MetricsExporter()

    app.add_exception_handler(ValueError, _bad_request)
    app.add_exception_handler(EngineError, _bad_request)
    app.add_middleware(_InternalErrors)
    app.add_middleware(Guard, options=options, reply=_refuse)  # outermost: before anything reads the request

    @app.post("/generate")
    async def generate(request: Request):
        # the hot path parses here rather than through Depends: FastAPI's resolving a dependency per request costs
        # more than validating a short body
        body = await GenerateBody.from_request(request)
        jobs, is_batch = jobs_of(body, engine)
        rids = [job.rid for job in jobs]
        clash = inflight.intersection(rids)
        if clash:
            raise ValueError(f"rid: {sorted(clash)[0]!r} is already in flight")
        if body.bootstrap is not None and prefill is None:
            raise ValueError(f"bootstrap: only a decode server takes it (this one is {engine.config.role})")
        submit = functools.partial(submitter, engine, prefill, body.bootstrap)
        if body.stream:
            return StreamingResponse(events(request, engine, jobs, is_batch, body, submit, inflight),
                                     media_type="text/event-stream")
        inflight.update(rids)
        try:
            outs = await unless_disconnected(request, generate_all(engine, jobs, submit))
        finally:
            inflight.difference_update(rids)
        if outs is None:
            return Response(status_code=499)  # nginx's "client closed request"; nobody is listening anyway
        results = [output(o, job, body, engine.tokenizer) for o, job in zip(outs, jobs, strict=True)]
        return _json(results if is_batch else results[0])

    @app.post("/pause_generation")
    async def pause_generation(body: Annotated[PauseBody, Depends(PauseBody.from_request)]):
        await engine.pause(body.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(body: Annotated[NoBody, Depends(NoBody.from_request)]):
        await engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort_request(request: Request, body: Annotated[AbortBody, Depends(AbortBody.from_request)]):
        """`{"rid": ...}` aborts one request; `{"abort_all": true}` every running and queued request (an admin's
        call). Unknown rids are ignored (the request may just have finished)."""
        if body.abort_all:
            if not request.scope[ADMIN]:
                raise Refused(403, "abort_all: aborting every request needs the admin API key")
            engine.abort_all()
            return {"success": True, "message": "abort sent for all requests"}
        if not body.rid:
            raise ValueError("rid: must be a non-empty string (or send abort_all: true)")
        engine.abort(body.rid)
        return {"success": True, "message": f"abort sent for {body.rid}"}

    @app.post("/flush_cache")
    async def flush_cache(body: Annotated[NoBody, Depends(NoBody.from_request)]):
        await engine.flush_cache()
        return {"success": True, "message": "Cache flushed."}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: Annotated[DiskUpdateBody, Depends(DiskUpdateBody.from_request)]):
        """Load every `*.safetensors` tensor in `model_path` into the (paused) engine. A bad checkpoint is a
        400 that leaves the weights and their version unchanged."""
        named = await asyncio.to_thread(_read_checkpoint, options.checkpoint_dir(body.model_path), body.model_path)
        version = await engine.update_weights(named, body.weight_version)
        return {"success": True, "message": f"Loaded {len(named)} tensors from {body.model_path}.",
                "weight_version": version}

    disagg.add_routes(app, engine, unless_disconnected)
    openai_api.add_routes(app, engine)

    @app.get("/health")
    async def health():
        if not engine.is_alive():
            return _error(503, "engine thread is not running", "ServiceUnavailable")
        try:  # a step is short: an engine that cannot answer within the timeout is stuck
            async with asyncio.timeout(HEALTH_TIMEOUT_S):  # (not `wait_for`: on 3.11 it may swallow a cancel)
                await engine.get_stats()
        except TimeoutError:
            return _error(503, f"engine thread did not answer within {HEALTH_TIMEOUT_S} s", "ServiceUnavailable")
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        stats = await engine.get_stats()
        return {**dataclasses.asdict(engine.model_config), "context_length": engine.max_context_len,
                "weight_version": stats.weight_version, "is_generation": True}

    @app.get("/get_server_info")
    async def get_server_info():
        return {**dataclasses.asdict(engine.config), "context_length": engine.max_context_len}

    @app.get("/metrics")
    async def metrics():
        sessions = getattr(app.state, "sessions", None)
        stats = exporter.render(await engine.get_stats(), sessions.stats() if sessions is not None else None)
        return Response(stats, media_type=CONTENT_TYPE_LATEST)

    @app.get("/engine_stats")
    async def engine_stats():
        return dataclasses.asdict(await engine.get_stats())

    _add_weight_group_routes(app, engine, groups, options)
    return app


# ---- weight updates over a torch.distributed group ---------------------------------------------------------
@dataclasses.dataclass
class _WeightGroup:
    receiver: DistReceiver
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)  # one transfer at a time


def _add_weight_group_routes(app: FastAPI, engine: Engine, groups: dict[str, _WeightGroup | None],
                             options: ServerOptions) -> None:
    joins = ThreadPoolExecutor(1, thread_name_prefix="tandem-group-join")  # never the default pool: see below
    def group_of(name: str) -> _WeightGroup:
        if groups.get(name) is None:
            raise ValueError(f"group_name: no weight group {name!r} (init it with /init_weights_update_group)")
        if groups[name].lock.locked():
            raise ValueError(f"group_name: a transfer on {name!r} is running")
        return groups[name]

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request,
                                        body: Annotated[InitGroupBody, Depends(InitGroupBody.from_request)]):
        """Join a weight group as rank `rank_offset` (rank 0, the trainer, hosts its store at master_address:
        master_port and must join meanwhile). Returns once every rank has joined; one that does not come within
        `timeout_s` (tandem's field, default 60; it also bounds every later collective) is a 500 naming it."""
        name, backend = body.group_name, body.backend
        if name in groups:
            raise ValueError(f"group_name: {name!r} is taken (destroy it first)")
        if None in groups.values():  # a join waits for its peers: one at a time, on a thread of its own
            raise ValueError("group_name: another weight group is being joined; retry when it has joined or failed")
        if body.timeout_s > options.max_group_timeout_s:
            raise ValueError(f"timeout_s: at most {options.max_group_timeout_s:g}, got {body.timeout_s:g}")
        if engine.tp.size > 1:
            raise ValueError("group_name: a tensor-parallel engine cannot join a weight group yet")
        if backend == "nccl" and not engine.config.device.startswith("cuda"):
            raise ValueError(f"backend: nccl needs the engine on a CUDA device, it is on {engine.config.device}")
        label = f"engine pid {os.getpid()} at {str(request.base_url).rstrip('/')}"
        groups[name] = None
        try:
            receiver = await asyncio.get_running_loop().run_in_executor(joins, functools.partial(
                DistReceiver, f"tcp://{body.master_address}:{body.master_port}", body.world_size, body.rank_offset,
                backend, body.timeout_s, label, engine.config.device if backend == "nccl" else None))
        except TransportError as e:  # the peers the client named did not come: its request failed, not the server
            return _error(400, str(e), "TransportError", extra={"success": False, "message": str(e)})
        finally:
            groups.pop(name)
        groups[name] = _WeightGroup(receiver)
        return {"success": True, "message": f"joined weight group {name!r} as rank {body.rank_offset}"}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(
            body: Annotated[GroupUpdateBody, Depends(GroupUpdateBody.from_request)]):
        """Receive one transfer from the group's sender and load it. The buckets arrive into a staging copy (one
        full copy of the weights on the engine's device) while the engine keeps generating; only the load excludes
        generation: the engine pauses (`pause_mode`, default retract) just for `update_weights`, then resumes. An
        engine already paused by a client loads and stays paused. Replies with the version loaded, `transfer_s`
        (the receive) and `pause_s` (generation excluded): a `SyncReply`'s fields. A failed transfer is a 500 that
        leaves the weights and their version unchanged, and the group unusable: destroy it and init another."""
        name, group = body.group_name, group_of(body.group_name)
        async with group.lock:
            try:
                reply = await receive_and_load(group.receiver, engine, body.weight_version, body.pause_mode)
            except TransportError as e:
                return _error(500, str(e), "TransportError", extra={"success": False, "message": str(e)})
            except (ValueError, EngineError) as e:
                return _error(400, str(e), extra={"success": False, "message": str(e)})
        return {"success": True, "message": f"loaded {reply.num_tensors} tensors from weight group {name!r}",
                **reply.to_dict()}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: Annotated[GroupBody, Depends(GroupBody.from_request)]):
        group = group_of(body.group_name)
        del groups[body.group_name]
        group.receiver.close()
        return {"success": True, "message": f"left weight group {body.group_name!r}"}


# ---- shared helpers --------------------------------------------------------------------------------------
def _read_checkpoint(path: Path, given: str) -> list:
    """Every tensor of the checkpoint in `path` (`given`: as the client named it), all finite."""
    try:
        named = list(iter_safetensors(path))
    except Exception as e:  # a missing, unreadable or corrupt checkpoint is the client's input, not our bug
        raise ValueError(f"model_path: cannot load {given!r}: {e}") from None
    for name, tensor in named:
        if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
            raise ValueError(f"model_path: {given!r}: tensor {name!r} holds NaN or infinite values")
    return named


def _json(content, status_code: int = 200) -> Response:
    """A JSON reply serialised by pydantic-core (in Rust: the engine's process serialises one per turn, holding the
    GIL its steps need). Infinite or NaN floats become null."""
    return Response(pydantic_core.to_json(content, inf_nan_mode="null"), status_code, media_type="application/json")


def _error(status: int, message: str, kind: str = "BadRequest", extra: dict | None = None) -> Response:
    return _json({"error": {"message": message, "type": kind}, **(extra or {})}, status)


async def _bad_request(request: Request, exc: Exception) -> Response:
    return _error(400, str(exc), extra={"success": False, "message": str(exc)})


async def _refuse(scope, receive, send, refusal: Refused) -> None:
    kind = {401: "Unauthorized", 403: "Forbidden", 408: "RequestTimeout", 413: "PayloadTooLarge"}[refusal.status]
    reply = _error(refusal.status, str(refusal), kind, extra={"success": False, "message": str(refusal)})
    if refusal.status == 401:
        reply.headers["WWW-Authenticate"] = "Bearer"
    await reply(scope, receive, send)


class _InternalErrors:
    """An unexpected exception becomes a 500 JSON reply here, inside the app: let through to the server, it
    would also close the connection, and a keep-alive client's next request on it would fail. A client that went
    away before its body arrived is no error (a 499 nobody reads)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        tracked = TrackedSend(send)
        try:
            await self.app(scope, receive, tracked)
        except Refused:
            raise  # the guard replies
        except ClientDisconnect:
            if not tracked.started:
                await Response(status_code=499)(scope, receive, send)
        except Exception as exc:
            if scope["type"] != "http" or tracked.started:
                raise
            log.error("%s %s failed", scope["method"], scope["path"], exc_info=exc)
            await _error(500, f"{type(exc).__name__}: {exc}", "InternalServerError")(scope, receive, send)


# ---- running it ------------------------------------------------------------------------------------------
# An idle connection is kept open this long: longer than clients keep theirs (`tandem.engine.client.IDLE_CLOSE_S`),
# so a client never sends on a connection the server is closing
KEEP_ALIVE_S = 75


def uvicorn_options(options: ServerOptions, keep_alive_s: float = KEEP_ALIVE_S) -> dict:
    """The `uvicorn.Config` arguments every tandem server (an engine's, a router's) runs with."""
    return dict(limit_concurrency=MAX_CONNECTIONS, http=options.protocol(), timeout_keep_alive=keep_alive_s)


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 30000, options: ServerOptions | None = None) -> None:
    """Serve `engine` until interrupted (blocking)."""
    options = options or ServerOptions()
    uvicorn.run(build_app(engine, options), host=host, port=port, log_level="info", **uvicorn_options(options))


class ServerThread:
    """The server in a background thread on a free port, for tests and in-process use:

        with ServerThread(engine) as server:
            httpx.post(f"{server.url}/generate", json=...)

    Exiting stops the server (in-flight requests get a few seconds, then are cancelled and aborted). Serves
    `engine` (its app built here) or another ASGI `app` (a router's)."""

    def __init__(self, engine: Engine | None = None, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", options: ServerOptions | None = None, app=None,
                 keep_alive_s: float = KEEP_ALIVE_S):
        # IPPROTO_TCP named, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections of a TCP
        # socket it recognises as one, and with Nagle on every reply with a body waits for the client's delayed ACK
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))  # bound here, so the port is known and free before uvicorn starts
        self.host, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        options = options or ServerOptions()
        app = build_app(engine, options) if app is None else app
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=3,
                                **uvicorn_options(options, keep_alive_s))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="tandem-http", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server on {self.url} failed to start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
