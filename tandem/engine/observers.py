"""Observers of the engine: measurements that benchmarks and runs switch on, kept off the engine's own path.

An observer is told what the scheduler admits and computes and when the cache is emptied; the engine calls it only
when one is configured (`EngineConfig.measure_ideal_reuse`), and nothing it measures travels in requests, outputs
or episodes: it reports through the engine's counters (`EngineStats`).
"""

from __future__ import annotations

from tandem.distributed.parallel import cdiv
from tandem.engine.kv_pool import PageAllocator
from tandem.engine.radix_cache import RadixCache


class IdealReuse:
    """What an ideal prefix cache (unbounded, never evicting, emptied only by weight updates) would have served:
    on each request's first admission, the longest prefix of its prompt the engine had computed before.
    `prompt_tokens` and `ideal_tokens` add up over first admissions."""

    def __init__(self, page_size: int, max_tokens: int):
        self.log = PrefixLog(page_size, max_tokens)
        self.prompt_tokens = self.ideal_tokens = 0

    def admitted(self, tokens: list[int]) -> None:
        """A request's first admission, with `tokens` its prompt (the last token is computed to sample)."""
        self.prompt_tokens += len(tokens)
        self.ideal_tokens += self.log.longest(tokens[:-1])

    def computed(self, tokens: list[int]) -> None:
        """The engine computed KV for `tokens` (from the start of a sequence)."""
        self.log.add(tokens)

    def cache_emptied(self) -> None:
        """Nothing computed before is reusable now (a weight update emptied the cache)."""
        self.log.reset()


class PrefixLog:
    """The longest prefix of a sequence this engine has computed (since it was last reset): what an ideal,
    unbounded cache would serve. Token ids only, no KV; beyond `max_tokens` the least recently used are
    forgotten."""

    def __init__(self, page_size: int, max_tokens: int):
        self.max_pages = max_tokens // page_size
        self.ids = _PageIds(page_size)
        self.tree = RadixCache(self.ids)

    def add(self, tokens: list[int]) -> None:
        pages = self.ids.alloc(cdiv(len(tokens), self.ids.page_size))
        self.tree.insert(tokens, pages)
        self.ids.decref(pages)
        over = self.ids.num_used - self.max_pages
        if over > 0:
            self.tree.evict(over)

    def longest(self, tokens: list[int]) -> int:
        return self.tree.match(tokens).num_tokens

    def reset(self) -> None:
        """Forget everything at once (inside a weight update's pause): ids are not storage, so none needs freeing
        one by one."""
        self.ids = _PageIds(self.ids.page_size)
        self.tree = RadixCache(self.ids)


class _PageIds(PageAllocator):
    """Page ids with no storage behind them, as many as asked for."""

    def __init__(self, page_size: int):
        super().__init__(0, page_size)

    def alloc(self, n: int) -> list[int]:
        grow = n - len(self._free)
        if grow > 0:
            self._free[:0] = range(self.num_pages + grow - 1, self.num_pages - 1, -1)
            self.refcount += [0] * grow
            self.num_pages += grow
        return super().alloc(n)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)
