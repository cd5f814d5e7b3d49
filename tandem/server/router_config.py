"""What `tandem router` routes to, and its knobs: a typed config that imports without torch."""

from __future__ import annotations

import dataclasses
import urllib.parse
from typing import Literal

from tandem.server.prefix_map import PAGE_TOKENS


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """The servers behind the router, each a base URL: `servers` (replicas), or `prefill` and `decode`."""

    servers: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    backend_api_key: str | None = None
    backend_admin_api_key: str | None = None
    connect_timeout_s: float = 5.0
    control_timeout_s: float = 600.0  # bounds each read of every call but a generate (`tandem.server.upstream`)
    health_timeout_s: float = 5.0
    probe_interval_s: float = 2.0  # how often a server marked down is asked whether it is back
    page_tokens: int = PAGE_TOKENS
    prefix_map_pages: int = 1 << 18  # per pool

    def __post_init__(self):
        if bool(self.servers) == bool(self.prefill or self.decode):
            raise ValueError("servers: give the replicas' URLs, or prefill and decode servers' URLs (not both)")
        if not self.servers and not (self.prefill and self.decode):
            raise ValueError("prefill, decode: prefill/decode mode needs at least one server of each")
        for field in ("servers", "prefill", "decode"):
            object.__setattr__(self, field, tuple(_base_url(u, field) for u in getattr(self, field)))
        urls = [*self.servers, *self.prefill, *self.decode]
        if len(set(urls)) < len(urls):
            raise ValueError(f"servers: {next(u for u in urls if urls.count(u) > 1)} is named twice")
        for name in ("connect_timeout_s", "control_timeout_s", "health_timeout_s", "probe_interval_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name}: must be positive and finite, got {getattr(self, name)!r}")
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens: must be at least 1, got {self.page_tokens}")

    @property
    def mode(self) -> Literal["replicas", "prefill_decode"]:
        return "replicas" if self.servers else "prefill_decode"


def _base_url(url: str, field: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") or parts.query:
        raise ValueError(f"{field}: {url!r} is not a server's base URL (such as http://127.0.0.1:30000)")
    return url.rstrip("/")
