"""`tandem router`: one HTTP endpoint in front of several servers, speaking their API (SGLang's native one, as
`tandem serve` does), so clients (the rollout manager's `EngineClient`, SGLang's clients, curl) never know the
difference.

Modes (`RouterConfig`): replicas, a `/generate` going to one of several unified servers; or prefill/decode, a
`/generate` going to a decode server with one field added, `"bootstrap": {"prefill_url": <a prefill server's base
URL>}` (`with_bootstrap`): the decode server fetches the prompt's KV from that prefill server and answers like a
unified server.

Routes:
  - `/generate`: placed by `tandem.server.prefix_map` (every turn of an episode on one server; a new episode on the
    least loaded), in prefill/decode mode the decode and the prefill server each by a pool of its own. A batch
    (`input_ids` a list of lists) goes whole to one server, so the server's own rules for a batch hold (its size
    limit, its 400s naming `input_ids[i][j]`, rids unique within it). The server's reply is relayed as it is, a
    400 (the client's fault) included; a server that does not answer, or answers another error, makes a 502
    naming it. One that did not answer is marked down until it answers a `/health` probe (`probe_interval_s`);
    meanwhile new prompts, and the next turns of its episodes, go to the others. A client that disconnects has its
    connection to the server closed, which aborts its requests there (as `tandem serve` aborts a disconnected
    client's).
  - `/pause_generation`, `/continue_generation`, `/flush_cache`, `/update_weights_from_disk`, `/abort_request`:
    checked here with the server's body models, then sent to every server at once (prefill and decode alike). A
    success once every server succeeded; else an error naming each server that failed and why, and those where it
    succeeded (a 400 if every failure was a 400, else a 502).
  - `/health`: healthy when every server is. `/get_model_info`: the first (decode) server's (the first not marked
    down). `/get_server_info`: that server's, with the router's view under `"router"` (its mode and, per server,
    its counters).
    `/engine_stats`: the servers' engine stats summed (times in engine-seconds, `weight_version` the lowest), so
    `EngineClient.get_stats` reads the router as one engine; a server that does not answer is left out while
    another does (and marked down). `/metrics`: the router's counters per server.
  - `/add_worker?url=` and `/remove_worker?url=` (admin; SGLang router's names): a server joins or leaves the
    replicas (a replica restarted, or one that died). A server joins only if it holds the weights of those already
    there (its `/get_model_info` `weight_version` equal to theirs; `weight_version=` in the query: equal to that),
    so a replica restarted with stale weights is refused rather than sent traffic; its first reply's lowest token
    version is kept in the router's view (`first_token_version`).
  - the OpenAI-compatible routes and session chat, in front of replicas: `tandem.server.router_chat`.
  - the weight-group routes are a 400: a group is joined by one server per rank, so fanning them out is
    meaningless; send them to each server.
Keys: `Guard` checks the router's clients under the router's own `ServerOptions`; the router sends its servers
`backend_api_key`, and `backend_admin_api_key` on the admin routes and fan-outs (each falling back to the other).
"""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import asynccontextmanager

import pydantic_core
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tandem.server.bodies import AbortBody, DiskUpdateBody, NoBody, PauseBody
from tandem.server.guard import ADMIN, Guard, Refused, ServerOptions
from tandem.server.http import _bad_request, _error, _InternalErrors, _json, _refuse, uvicorn_options
from tandem.server.prefix_map import Backend, Pool
from tandem.server.router_chat import add_chat_routes
from tandem.server.router_config import RouterConfig
from tandem.server.upstream import Reply, Upstream

FAN_OUT = {"/pause_generation": PauseBody, "/continue_generation": NoBody, "/flush_cache": NoBody,
           "/update_weights_from_disk": DiskUpdateBody, "/abort_request": AbortBody}
WEIGHT_GROUP_PATHS = ("/init_weights_update_group", "/update_weights_from_distributed",
                      "/destroy_weights_update_group")
RELAYED = frozenset({200, 400, 408, 413})  # a server's statuses passed on as they are; others make a 502


def with_bootstrap(body: dict, prefill_url: str) -> dict:
    """The `/generate` body a decode server gets: the client's, plus the prefill server to fetch the KV from."""
    if "bootstrap" in body:
        raise ValueError("bootstrap: the router sets it (it picks the prefill server); leave it out")
    return {**body, "bootstrap": {"prefill_url": prefill_url}}


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a `/generate` goes: `target` (a decode server in prefill/decode mode) with `body`, naming `source`."""

    target: Backend
    source: Backend | None
    body: bytes
    prompts: list[list[int]]  # empty if the body is not a well-formed request (the server then says why)


class Router:
    """The router's state: its pools of servers with their counters, and its connections to them (`upstream`,
    opened in the serving event loop). Everything runs on that loop."""

    def __init__(self, config: RouterConfig):
        self.config = config
        pool = lambda urls, role: Pool([Backend(u, role) for u in urls], config.page_tokens, config.prefix_map_pages)
        self.pool = pool(config.servers, "unified") if config.servers else pool(config.decode, "decode")
        self.prefill = pool(config.prefill, "prefill") if config.prefill else None
        self.upstream = Upstream(config.connect_timeout_s, config.backend_api_key, config.backend_admin_api_key)

    @property
    def backends(self) -> list[Backend]:
        """Every server in rotation (the decode or unified ones first)."""
        return self.pool.backends + (self.prefill.backends if self.prefill else [])

    async def add_worker(self, url: str, weight_version: int | None) -> dict:
        """Put the unified server at `url` into rotation once it answers and holds the weights of the servers in
        rotation (and `weight_version`, if given). ValueError (a 400) naming the difference otherwise."""
        if self.prefill is not None:
            raise ValueError("url: add_worker adds a replica; this router routes to prefill/decode pairs")
        backend = Backend(url.rstrip("/"), "unified")
        info = await self._model_info(backend)
        held, others = info["weight_version"], [(await self._model_info(b))["weight_version"]
                                               for b in self.pool.backends if not b.down]
        expected = weight_version if weight_version is not None else (max(others) if others else held)
        if held != expected or any(v != expected for v in others):
            raise ValueError(f"url: {backend.url} holds weights version {held}, the servers in rotation "
                             f"{sorted(set(others))}" + (f", the caller expects {weight_version}"
                                                         if weight_version is not None else "")
                             + ": it joins only with the same weights")
        backend.weight_version = held
        self.pool.add(backend)
        return {"success": True, "message": f"added {backend.url} at weight version {held}",
                "weight_version": held}

    def remove_worker(self, url: str) -> dict:
        backend = self.pool.remove(url.rstrip("/"))
        return {"success": True, "message": f"removed {backend.url}"}

    async def _model_info(self, backend: Backend) -> dict:
        reply = await self.call(backend, "GET", "/get_model_info", None, self.config.health_timeout_s)
        if reply.status != 200:
            raise ValueError(f"url: {backend.url}: GET /get_model_info: {reply.reason()}")
        return pydantic_core.from_json(reply.content)

    def place(self, raw: bytes) -> Placement:
        """Choose the server(s) for a `/generate` body (recording its prompts there) and shape the body it gets.
        ValueError for a body the router itself refuses."""
        try:
            body = pydantic_core.from_json(raw)
        except ValueError:
            body = None
        prompts = _prompts(body)
        target = self.pool.choose(prompts)
        if self.prefill is None or not isinstance(body, dict):
            return Placement(target, None, raw, prompts)
        source = self.prefill.choose(prompts)
        return Placement(target, source, pydantic_core.to_json(with_bootstrap(body, source.url)), prompts)

    async def generate(self, request: Request) -> Response:
        if not self.pool.backends:
            return _error(503, "no server to route to: every one has left the rotation", "ServiceUnavailable")
        raw = await request.body()
        placed = self.place(raw)
        servers, n = [b for b in (placed.target, placed.source) if b is not None], max(len(placed.prompts), 1)
        for b in servers:
            b.in_flight, b.routed = b.in_flight + n, b.routed + n
        if _streamed(raw):
            return await self._relay_stream(placed.target, "/generate", placed.body, servers, n)
        try:
            reply = await _unless_disconnected(request, self.call(placed.target, "POST", "/generate", placed.body))
        finally:
            for b in servers:
                b.in_flight -= n
        if reply is None:
            return Response(status_code=499)  # nginx's "client closed request"; nobody is listening anyway
        if reply.status == 200:
            self._remember_outputs(placed, reply.content)
        return self._relay(placed.target, "POST /generate", reply)

    async def _relay_stream(self, target: Backend, path: str, body: bytes, servers: list[Backend], n: int,
                            relayed: frozenset = RELAYED) -> Response:
        """A streamed request (`stream: true`): the target's events relayed as they come; a client that goes away
        closes the connection to the target, which aborts its requests there."""
        reply, upstream = await self.upstream.open_stream(target.url, path, body)
        target.down = not reply.status
        if upstream is None:
            for b in servers:
                b.in_flight -= n
            return self._relay(target, f"POST {path}", reply, relayed)

        async def relay():
            try:
                async for chunk in upstream.content.iter_any():
                    yield chunk
            finally:
                upstream.close()
                for b in servers:
                    b.in_flight -= n

        return StreamingResponse(relay(), media_type="text/event-stream")

    def _remember_outputs(self, placed: Placement, content: bytes) -> None:
        """The target's cache now holds each prompt followed by its output, which the episode's next turn extends."""
        try:
            outs = pydantic_core.from_json(content)
        except ValueError:  # the client gets it as it is: not our business here
            return
        for prompt, out in zip(placed.prompts, outs if isinstance(outs, list) else [outs], strict=False):
            if isinstance(out, dict) and isinstance(out.get("output_ids"), list):
                self.pool.remember(prompt + out["output_ids"], placed.target)
                versions = out.get("meta_info", {}).get("output_token_weight_versions")
                if placed.target.first_token_version is None and versions:
                    placed.target.first_token_version = min(versions)

    async def fan_out(self, path: str, raw: bytes) -> Response:
        backends = self.backends  # (as they were when it began: servers may join or leave meanwhile)
        if not backends:
            return _error(503, f"{path}: no server in rotation", "ServiceUnavailable")
        replies = await asyncio.gather(*(self.call(b, "POST", path, raw, self.config.control_timeout_s, admin=True)
                                         for b in backends))
        failed = [(b, r) for b, r in zip(backends, replies, strict=True) if r.status != 200]
        if not failed:
            return Response(replies[0].content, 200, media_type="application/json")
        succeeded = [b.url for b, r in zip(backends, replies, strict=True) if r.status == 200]
        message = (f"{path} failed on {len(failed)} of {len(backends)} servers: "
                   + "; ".join(f"server {b.url}: {r.reason()}" for b, r in failed)
                   + (f" (it succeeded on {', '.join(succeeded)})" if succeeded else ""))
        refused = all(r.status == 400 for _, r in failed)
        for b, r in failed:
            b.errors += r.status != 400
        return _error(400 if refused else 502, message, "BadRequest" if refused else "BadGateway",
                      extra={"success": False, "message": message})

    async def health(self) -> Response:
        backends = self.backends
        replies = await asyncio.gather(*(self.call(b, "GET", "/health", None, self.config.health_timeout_s)
                                         for b in backends))
        failed = [f"server {b.url}: {r.reason()}" for b, r in zip(backends, replies, strict=True)
                  if r.status != 200]
        if failed:
            return _error(503, "unhealthy: " + "; ".join(failed), "ServiceUnavailable")
        return Response(status_code=200)

    async def first(self, path: str) -> tuple[dict | None, Response | None]:
        """The JSON answer to `GET path` of the first (decode) server not marked down, or (None, the error reply)."""
        backend = next((b for b in self.pool.backends if not b.down), self.pool.backends[0])
        reply = await self.call(backend, "GET", path, None, self.config.control_timeout_s)
        if reply.status != 200:
            return None, self._relay(backend, f"GET {path}", reply)
        return pydantic_core.from_json(reply.content), None

    async def engine_stats(self) -> Response:
        backends = self.backends
        if not backends:
            return _error(503, "no server in rotation", "ServiceUnavailable")
        replies = await asyncio.gather(*(self.call(b, "GET", "/engine_stats", None, self.config.control_timeout_s)
                                         for b in backends))
        answered = [r for r in replies if r.status]
        for b, r in zip(backends, replies, strict=True):
            if r.status != 200 and (r.status or not answered):
                return self._relay(b, "GET /engine_stats", r)
        # a server that did not answer (now marked down) is left out while others answer: a replica that just died
        return _json(_sum_stats([pydantic_core.from_json(r.content) for r in answered]))

    async def forward(self, request: Request, backend: Backend | None = None,
                      relayed: frozenset = RELAYED) -> Response:
        """`request` relayed to `backend` (default: the least loaded) as it is, a stream as it comes."""
        path = request.url.path
        backend = backend or self.pool.choose([])
        raw = await request.body() if request.method == "POST" else None
        backend.in_flight, backend.routed = backend.in_flight + 1, backend.routed + 1
        if raw is not None and _streamed(raw):
            return await self._relay_stream(backend, path, raw, [backend], 1, relayed)
        try:
            reply = await _unless_disconnected(request, self.call(backend, request.method, path, raw))
        finally:
            backend.in_flight -= 1
        if reply is None:
            return Response(status_code=499)
        return self._relay(backend, f"{request.method} {path}", reply, relayed)

    def view(self) -> dict:
        return {"mode": self.config.mode, "servers": [dataclasses.asdict(b) for b in self.backends]}

    async def call(self, backend: Backend, method: str, path: str, body: bytes | None,
                   read_timeout_s: float | None = None, admin: bool = False) -> Reply:
        """A call to `backend`, marking it down if it did not answer and up if it did."""
        reply = await self.upstream.call(backend.url, method, path, body, read_timeout_s, admin)
        backend.down = not reply.status
        return reply

    async def probe(self) -> None:
        """Forever: ask each server marked down for `/health`, so one that answers again takes new prompts."""
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            await asyncio.gather(*(self.call(b, "GET", "/health", None, self.config.health_timeout_s)
                                   for b in self.backends if b.down))

    def _relay(self, backend: Backend, what: str, reply: Reply, relayed: frozenset = RELAYED) -> Response:
        if reply.status in relayed:
            return Response(reply.content, reply.status, media_type="application/json")
        backend.errors += 1
        message = f"server {backend.url}: {what}: {reply.reason()}"
        return _error(502, message, "BadGateway", extra={"success": False, "message": message})


def _streamed(raw: bytes) -> bool:
    """Whether a `/generate` body asks for a stream."""
    try:
        body = pydantic_core.from_json(raw)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("stream") is True


def _prompts(body) -> list[list[int]]:
    """The prompts of a `/generate` body (one, or a batch), or [] if it has no well-formed `input_ids`."""
    ids = body.get("input_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not ids:
        return []
    prompts = ids if isinstance(ids[0], list) else [ids]
    ok = all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompts)
    return prompts if ok else []


def _sum_stats(stats: list[dict]) -> dict:
    """One engine's stats from several: counters and gauges summed, flags all of them, `weight_version` the lowest,
    `slowest_iteration_seconds` the longest."""
    total = {}
    for key, value in stats[0].items():
        values = [s.get(key, value) for s in stats]
        if key == "weight_version":
            total[key] = min(values)
        elif key == "slowest_iteration_seconds":
            total[key] = max(values)
        elif isinstance(value, bool):
            total[key] = all(values)
        elif isinstance(value, int | float):
            total[key] = sum(values)
        else:
            total[key] = value
    return total


async def _unless_disconnected(request: Request, coro):
    """Await `coro` unless the client disconnects first: then cancel it (closing its connection to the server, which
    aborts the request there) and return None."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Metrics:
    """The router's counters per server, under `tandem:router_`, in a Prometheus registry of its own."""

    def __init__(self, router: Router):
        self.router = router
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self):
        for name, doc, kind, get in (
                ("requests", "Prompts routed to the server", CounterMetricFamily, lambda b: b.routed),
                ("in_flight", "Prompts in flight on the server through this router", GaugeMetricFamily,
                 lambda b: b.in_flight),
                ("errors", "Requests the server failed (no answer, or an error not the client's)",
                 CounterMetricFamily, lambda b: b.errors),
                ("server_up", "1 while the server answers (else new prompts go elsewhere)", GaugeMetricFamily,
                 lambda b: int(not b.down))):
            family = kind(f"tandem:router_{name}", doc, labels=["server", "role"])
            for b in self.router.backends:
                family.add_metric([b.url, b.role], get(b))
            yield family


def build_router_app(config: RouterConfig, options: ServerOptions | None = None) -> FastAPI:
    """A FastAPI app routing to `config`'s servers under `options` (the router's own keys and limits)."""
    router = Router(config)
    metrics = _Metrics(router)

    @asynccontextmanager
    async def lifespan(app):
        await router.upstream.open()
        probe = asyncio.create_task(router.probe())
        yield
        probe.cancel()
        await router.upstream.close()

    app = FastAPI(title="tandem router", lifespan=lifespan)
    app.add_exception_handler(ValueError, _bad_request)
    app.add_middleware(_InternalErrors)
    app.add_middleware(Guard, options=options or ServerOptions(), reply=_refuse)  # outermost

    app.add_api_route("/generate", router.generate, methods=["POST"])
    add_chat_routes(app, router)
    for path, body_type in FAN_OUT.items():
        app.add_api_route(path, _fan_out_route(router, path, body_type), methods=["POST"])

    async def refuse_weight_group(request: Request):
        raise ValueError(f"{request.url.path}: a weight group is joined by one server per rank; the router cannot "
                         f"fan it out to its {len(router.backends)} servers: call each server directly")

    for path in WEIGHT_GROUP_PATHS:
        app.add_api_route(path, refuse_weight_group, methods=["POST"])

    @app.post("/add_worker")
    async def add_worker(request: Request, url: str, weight_version: int | None = None):
        if not request.scope[ADMIN]:
            raise Refused(403, "add_worker: needs the admin API key")
        return await router.add_worker(url, weight_version)

    @app.post("/remove_worker")
    async def remove_worker(request: Request, url: str):
        if not request.scope[ADMIN]:
            raise Refused(403, "remove_worker: needs the admin API key")
        return router.remove_worker(url)

    @app.get("/health")
    async def health():
        return await router.health()

    @app.get("/get_model_info")
    async def get_model_info():
        info, error = await router.first("/get_model_info")
        return error or _json(info)

    @app.get("/get_server_info")
    async def get_server_info():
        info, error = await router.first("/get_server_info")
        return error or _json({**info, "router": router.view()})

    @app.get("/engine_stats")
    async def engine_stats():
        return await router.engine_stats()

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _fan_out_route(router: Router, path: str, body_type):
    async def route(request: Request):
        body = await body_type.from_request(request)  # refused here once, rather than by every server
        if getattr(body, "abort_all", False) and not request.scope[ADMIN]:
            raise Refused(403, "abort_all: aborting every request needs the admin API key")
        return await router.fan_out(path, await request.body())

    return route


def serve_router(config: RouterConfig, host: str = "127.0.0.1", port: int = 30000,
                 options: ServerOptions | None = None) -> None:
    """Serve the router until interrupted (blocking)."""
    options = options or ServerOptions()
    uvicorn.run(build_router_app(config, options), host=host, port=port, log_level="info",
                **uvicorn_options(options))
