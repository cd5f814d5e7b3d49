"""Who may call the server, and how much they may send: API keys, an admin key, and limits on request bodies.

`ServerOptions` says it; `Guard` (an ASGI middleware, outermost) enforces it before a route sees the request:
  - with an `api_key`, every endpoint but `/health` needs `Authorization: Bearer <api_key>` (401 otherwise);
  - with an `admin_api_key`, the admin endpoints (`ADMIN_PATHS`: pausing, weights, weight groups, the cache, and
    aborting every request) need that key (403 for the client key), and the admin key may call everything; without
    one, the client key (or, without keys, anyone) may call them;
  - a body larger than `max_body_bytes` is a 413, one whose next piece takes longer than `body_timeout_s` a 408,
    and a connection whose request headers are not complete within `header_timeout_s` is closed (`protocol`): a
    client that trickles its request cannot hold the server's memory or connections for long;
  - `/update_weights_from_disk` reads only inside `weight_dirs` (the model's directory, as `tandem serve` sets it;
    none: the endpoint refuses every path).
Keys are compared in constant time. A refusal is a JSON error naming what was wrong, with SGLang's error shape.
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass
from pathlib import Path

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

ADMIN_PATHS = frozenset({"/pause_generation", "/continue_generation", "/flush_cache", "/update_weights_from_disk",
                         "/init_weights_update_group", "/update_weights_from_distributed",
                         "/destroy_weights_update_group"})
OPEN_PATHS = frozenset({"/health"})
ADMIN = "tandem.admin"  # the scope key saying whether the caller may use admin endpoints (aborting all requests)


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = None
    admin_api_key: str | None = None
    max_body_bytes: int = 64 << 20
    body_timeout_s: float = 30.0
    header_timeout_s: float = 30.0
    weight_dirs: tuple[str, ...] = ()
    max_group_timeout_s: float = 600.0  # the longest `timeout_s` a weight-group join may ask for

    def __post_init__(self):
        for name in ("api_key", "admin_api_key"):
            key = getattr(self, name)
            if key is not None and (not isinstance(key, str) or len(key) < 8 or not key.isprintable()
                                    or key != key.strip()):
                raise ValueError(f"{name}: must be at least 8 printable characters without surrounding spaces")
        if self.max_body_bytes <= 0 or not all(0 < t < float("inf") for t in (self.body_timeout_s,
                                                                                self.header_timeout_s)):
            raise ValueError("max_body_bytes, body_timeout_s and header_timeout_s: must be positive and finite")
        if not 0 < self.max_group_timeout_s < float("inf"):
            raise ValueError("max_group_timeout_s: must be positive and finite")

    def checkpoint_dir(self, model_path: str) -> Path:
        """`model_path` resolved (links followed), if it lies inside an allowed weight directory; else ValueError."""
        if not self.weight_dirs:
            raise ValueError("model_path: this server loads no weights from disk (start it with --weight-dir DIR)")
        path = Path(model_path).resolve()
        for allowed in self.weight_dirs:
            if path.is_relative_to(Path(allowed).resolve()):
                return path
        raise ValueError(f"model_path: {model_path!r} is outside the directories this server loads weights from")


    def protocol(self) -> type[H11Protocol]:
        """uvicorn's HTTP/1.1 protocol, closing connections whose request headers take over `header_timeout_s`."""
        return type("GuardedH11", (_HeaderTimeout,), {"header_timeout_s": self.header_timeout_s})


class _HeaderTimeout(H11Protocol):
    """A connection waiting for a request's headers (its first, or the next one on a kept-alive connection that
    has started sending it) is closed when they do not complete in time; uvicorn bounds only idle keep-alive."""

    header_timeout_s = 30.0
    _timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # (still) waiting for the headers of a request
            if self._timer is None:
                self._arm()
        elif self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._timer = self.loop.call_later(self.header_timeout_s, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class Refused(Exception):
    """A request refused before its route ran (or while it read its body): `status` and a message naming why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class TrackedSend:
    """An ASGI `send` that remembers whether the response has started (after that, no other reply may be sent)."""

    def __init__(self, send):
        self.send, self.started = send, False

    async def __call__(self, message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)


class Guard:
    """ASGI middleware enforcing `options` (see the module docstring); `reply(scope, receive, send, refusal)`
    sends a refusal."""

    def __init__(self, app, options: ServerOptions, reply):
        self.app, self.options, self.reply = app, options, reply

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        tracked = TrackedSend(send)
        try:
            scope[ADMIN] = self._authorize(scope)
            await self.app(scope, self._limited(scope, receive), tracked)
        except Refused as refusal:
            if tracked.started:
                raise
            await self.reply(scope, receive, send, refusal)

    def _authorize(self, scope) -> bool:
        """Whether the caller may use admin endpoints; Refused if it may not call this one."""
        path, opts = scope["path"], self.options
        if path in OPEN_PATHS:
            return False
        key = _bearer(scope)
        admin = opts.admin_api_key is not None and _same(key, opts.admin_api_key)
        client = admin or opts.api_key is None or _same(key, opts.api_key)
        may_admin = admin or (opts.admin_api_key is None and client)
        if not client:
            raise Refused(401, f"{path}: missing or wrong API key (send Authorization: Bearer <key>)")
        if path in ADMIN_PATHS and not may_admin:
            raise Refused(403, f"{path}: an admin endpoint; it needs the admin API key")
        return may_admin

    def _limited(self, scope, receive):
        """`receive` bounded in bytes and in the time each piece of the body may take."""
        limit, timeout = self.options.max_body_bytes, self.options.body_timeout_s
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise Refused(413, f"request body: {int(length)} bytes is over the limit of {limit}")
        state = {"bytes": 0, "done": False}

        async def receive_limited():
            if state["done"]:  # the body is in: later receives wait for a disconnect, unbounded
                return await receive()
            try:
                async with asyncio.timeout(timeout):  # (not `wait_for`: on 3.11 it may swallow a cancel)
                    message = await receive()
            except TimeoutError:
                raise Refused(408, f"request body: no data for {timeout:g} s") from None
            if message["type"] == "http.request":
                state["bytes"] += len(message.get("body", b""))
                state["done"] = not message.get("more_body", False)
                if state["bytes"] > limit:
                    raise Refused(413, f"request body: over the limit of {limit} bytes")
            return message

        return receive_limited


def _bearer(scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _same(given: str | None, key: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), key.encode())
