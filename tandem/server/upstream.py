"""The router's connections to its servers: one aiohttp connection pool, and each call's outcome as a `Reply`,
never an exception.

Connecting is bounded (`connect_timeout_s`), and so is each read of a call given a `read_timeout_s`; a generate's
read is not (it takes as long as its tokens take). A server that dies breaks its connections, which fails their
calls at once; one that vanishes without closing them (its host down, the network cut) is found by TCP keepalive
probes (`KEEPALIVE_S`), so no call waits forever.
"""

from __future__ import annotations

import dataclasses
import socket

import aiohttp
import pydantic_core

from tandem.engine.client import IDLE_CLOSE_S

KEEPALIVE_S = (10, 5, 3)  # idle seconds before the first probe, seconds between probes, probes unanswered


@dataclasses.dataclass(frozen=True)
class Reply:
    """A server's answer: its status and body; or status 0 and why there was none."""

    status: int
    content: bytes = b""
    failure: str = ""

    def reason(self) -> str:
        """Why it failed, in a few words: `HTTP 503: <the server's message>`, or the connection's error."""
        if not self.status:
            return self.failure
        try:
            message = pydantic_core.from_json(self.content)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = self.content[:500].decode(errors="replace")
        return f"HTTP {self.status}: {message}"


class Upstream:
    """Calls to the servers with the router's keys for them: `api_key`, and `admin_api_key` for admin calls (each
    falling back to the other). `open` in the event loop that will make the calls (the pool belongs to it)."""

    def __init__(self, connect_timeout_s: float, api_key: str | None = None, admin_api_key: str | None = None):
        self.connect_timeout_s = connect_timeout_s
        self._keys = (admin_api_key, api_key)
        self._http: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, socket_factory=_keepalive_socket,  # every generate holds one
                                         keepalive_timeout=IDLE_CLOSE_S)
        self._http = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout())

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def call(self, url: str, method: str, path: str, body: bytes | None = None,
                   read_timeout_s: float | None = None, admin: bool = False) -> Reply:
        """`method path` on the server at `url` with a JSON `body`; `read_timeout_s` None: reads unbounded."""
        key = next((k for k in (self._keys if admin else self._keys[::-1]) if k), None)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if body is not None:
            headers["Content-Type"] = "application/json"
        timeout = aiohttp.ClientTimeout(sock_connect=self.connect_timeout_s, sock_read=read_timeout_s)
        try:
            async with self._http.request(method, url + path, data=body, headers=headers, timeout=timeout) as reply:
                return Reply(reply.status, await reply.read())
        except (aiohttp.ClientError, TimeoutError) as e:
            return Reply(0, failure=f"{type(e).__name__}: {str(e) or 'no answer'}")


    async def open_stream(self, url: str, path: str, body: bytes) -> tuple[Reply, aiohttp.ClientResponse | None]:
        """POST `body` to `path` of the server at `url` for a stream of server-sent events: (Reply(200), the open
        response, whose `content` the caller reads and which it must `close`: closing it early tells the server the
        client went away); any other answer: (its Reply, None)."""
        key = next((k for k in self._keys[::-1] if k), None)
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        timeout = aiohttp.ClientTimeout(sock_connect=self.connect_timeout_s)
        try:
            reply = await self._http.request("POST", url + path, data=body, headers=headers, timeout=timeout)
            if reply.status == 200 and reply.content_type == "text/event-stream":
                return Reply(200), reply
            async with reply:
                return Reply(reply.status, await reply.read()), None
        except (aiohttp.ClientError, TimeoutError) as e:
            return Reply(0, failure=f"{type(e).__name__}: {str(e) or 'no answer'}"), None


def _keepalive_socket(addr_info) -> socket.socket:
    """A TCP socket that probes an idle connection (`KEEPALIVE_S`), failing it within about 25 s of the peer's
    vanishing."""
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
        for option, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE_S, strict=True):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    return sock
