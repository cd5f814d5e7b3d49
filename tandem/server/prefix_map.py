"""Cache-aware, sticky placement for the router: which server of a pool a prompt goes to.

A prompt is cut into pages of `page_tokens` tokens; page i's key is a hash of page i chained with page i-1's key,
so one key names the whole prefix up to its page's end. A `PrefixMap` remembers, for the most recently used keys,
the server that last took a request with that prefix. A `Pool` sends a prompt to the server of its deepest known
key (the server whose prefix cache holds most of it: every turn of an episode extends the previous turn, so they
all go where the first went), else to the least-loaded server (fewest prompts in flight, then fewest routed).
Then every key of the prompt maps to the chosen server. A hash collision (64 bits) only costs a cache miss.
A server marked down is passed over (its episodes move, paying one prefill each), unless every server is down.
Servers join and leave a pool (`add`, `remove`: a replica restarted, or one that died); the keys of one that left
are passed over as a down one's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

PAGE_TOKENS = 16


def page_keys(input_ids: list[int], page_tokens: int = PAGE_TOKENS) -> list[int]:
    """The chained key of each full page of `input_ids` (a partial last page has none)."""
    keys, key = [], 0
    for end in range(page_tokens, len(input_ids) + 1, page_tokens):
        key = hash((key, *input_ids[end - page_tokens:end]))
        keys.append(key)
    return keys


class PrefixMap:
    """Page keys -> a server (any object: the pool's `Backend`), at most `capacity` keys (the least recently used
    dropped first)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity: must be at least 1, got {capacity}")
        self.capacity = capacity
        self._server: OrderedDict[int, object] = OrderedDict()

    def __len__(self) -> int:
        return len(self._server)

    def deepest(self, keys: list[int], among=None) -> tuple[int, object] | None:
        """(depth in pages, server) of the deepest of `keys` known (on a server in `among`, if given), or None."""
        for depth in range(len(keys), 0, -1):
            server = self._server.get(keys[depth - 1])
            if server is not None and (among is None or server in among):
                return depth, server
        return None

    def record(self, keys: list[int], server) -> None:
        for key in keys:
            self._server[key] = server
            self._server.move_to_end(key)
        while len(self._server) > self.capacity:
            self._server.popitem(last=False)


@dataclass(eq=False)  # one per server: compared by identity
class Backend:
    """One server behind the router, with the router's counters for it (in prompts: a batch of n counts n)."""

    url: str
    role: str  # "unified", "prefill" or "decode"
    in_flight: int = 0
    routed: int = 0
    errors: int = 0  # requests it failed (no answer, or an error status other than the client's fault)
    down: bool = False  # its last call got no answer: new prompts go elsewhere until it answers again
    weight_version: int | None = None  # the version it held when it joined (`Router.add_worker`)
    first_token_version: int | None = None  # the lowest weight version of the tokens of its first reply


class Pool:
    """The servers of one role and the prefix map that places prompts on them. Not thread-safe: the router's
    event loop owns it."""

    def __init__(self, backends: list[Backend], page_tokens: int = PAGE_TOKENS, capacity: int = 1 << 18):
        if not backends:
            raise ValueError("a pool needs at least one server")
        self.backends, self.page_tokens = backends, page_tokens
        self.map = PrefixMap(capacity)

    def choose(self, prompts: list[list[int]]) -> Backend:
        """The server for a request of `prompts` (one, or a batch sent whole: the deepest prefix any of them has
        decides), among those not down (unless all are); records every page of every prompt as placed there. Does
        not count the request in flight. ValueError when the pool has no server."""
        if not self.backends:
            raise ValueError("no server to route to: every one has left the pool")
        keys = [page_keys(p, self.page_tokens) for p in prompts]
        up = [b for b in self.backends if not b.down] or self.backends
        known = [found for k in keys if (found := self.map.deepest(k, up)) is not None]
        if known:
            backend = max(known, key=lambda found: found[0])[1]
        else:
            backend = min(up, key=lambda b: (b.in_flight, b.routed, self.backends.index(b)))
        for k in keys:
            self.map.record(k, backend)
        return backend

    def remember(self, prompt: list[int], server: Backend) -> None:
        """Record `prompt` (a prompt and what the server generated after it) as cached on `server`."""
        if server in self.backends:
            self.map.record(page_keys(prompt, self.page_tokens), server)

    def add(self, backend: Backend) -> None:
        if any(b.url == backend.url for b in self.backends):
            raise ValueError(f"url: {backend.url} is in the pool already")
        self.backends.append(backend)

    def remove(self, url: str) -> Backend:
        """Take the server at `url` out of the pool (its keys are passed over from now on); ValueError if absent."""
        backend = next((b for b in self.backends if b.url == url), None)
        if backend is None:
            raise ValueError(f"url: {url} is not in the pool")
        self.backends.remove(backend)
        return backend
