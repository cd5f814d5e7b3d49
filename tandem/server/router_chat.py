"""The router's OpenAI-compatible routes, in front of unified replicas (in prefill/decode mode a 400: they are a
unified server's): `/v1/models` from the first server up; `/v1/completions` and `/v1/chat/completions` to the
least loaded, relayed as they are (a stream as it comes); session chat (`/sessions/{id}/...`) to one server per
session, the one its first turn went to, since a session's token history lives there (a server that left the
rotation: its sessions start over on another); `GET /sessions` the servers' counters summed."""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.responses import Response

from tandem.server.http import _json
from tandem.server.prefix_map import Backend

if TYPE_CHECKING:
    from tandem.server.router import Router

RELAYED = frozenset({200, 400, 404, 408, 409, 413})  # (404: an unknown session; 409: one busy with a request)
MAX_SESSIONS = 1 << 16  # sessions whose server the router remembers (least recently used forgotten first)


class SessionServers:
    """Session id -> the server holding its history, least recently used forgotten past `MAX_SESSIONS`."""

    def __init__(self, router: Router):
        self.router = router
        self.servers: collections.OrderedDict[str, Backend] = collections.OrderedDict()

    def of(self, session_id: str) -> Backend:
        """The server its first turn went to while it stays in rotation, else the least loaded (from then on)."""
        backend = self.servers.get(session_id)
        if backend is None or backend not in self.router.pool.backends:
            backend = self.servers[session_id] = self.router.pool.choose([])
        self.servers.move_to_end(session_id)
        while len(self.servers) > MAX_SESSIONS:
            self.servers.popitem(last=False)
        return backend


def add_chat_routes(app: FastAPI, router: Router) -> None:
    sessions = SessionServers(router)

    def unified(path: str) -> None:
        if router.prefill is not None:
            raise ValueError(f"{path}: the OpenAI-compatible routes are a unified server's; this router routes to "
                             "prefill/decode pairs (send /generate)")
        if not router.pool.backends:
            raise ValueError(f"{path}: no server in rotation")

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def completions(request: Request):
        unified(request.url.path)
        return await router.forward(request, relayed=RELAYED)

    @app.get("/v1/models")
    async def models(request: Request):
        unified("/v1/models")
        first = next((b for b in router.pool.backends if not b.down), router.pool.backends[0])
        return await router.forward(request, first, RELAYED)

    @app.get("/sessions")
    async def counters():
        unified("/sessions")
        backends = router.pool.backends
        replies = await asyncio.gather(*(router.call(b, "GET", "/sessions", None, router.config.control_timeout_s)
                                         for b in backends))
        for b, r in zip(backends, replies, strict=True):
            if r.status != 200:
                return router._relay(b, "GET /sessions", r, RELAYED)
        counts = [pydantic_core.from_json(r.content) for r in replies]
        total = {k: sum(c[k] for c in counts) if k != "ttl_s" else v for k, v in counts[0].items()}
        return _json(total)

    @app.api_route("/sessions/{session_id}/v1/chat/completions", methods=["POST"])
    @app.api_route("/sessions/{session_id}", methods=["GET", "DELETE"])
    async def session(request: Request, session_id: str) -> Response:
        unified(request.url.path)
        backend = sessions.of(session_id)
        if request.method == "DELETE":
            sessions.servers.pop(session_id, None)
        return await router.forward(request, backend, RELAYED)
