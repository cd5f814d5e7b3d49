"""Continuous batching: which tokens of which requests the next step computes, and who owns which pages.

Every step is a list of chunks, one per scheduled request: `num_tokens` of its known-but-uncomputed
tokens starting at `num_computed`. A decode is a chunk of one token; a prefill chunk is longer and draws
on a per-step token budget (chunked prefill). A chunk that reaches the end of a request's known tokens
is sampled from. Running requests go first, oldest first; then waiting ones are admitted in order, each
skipping the prefix the radix cache already holds.

A cached prefix may be partly on the host tier: admission copies those pages back into fresh device pages
(`RadixCache.load`) instead of recomputing them, and the next waiting requests have theirs prefetched while they
wait (`HostTier.prefetch`), so that the copy has crossed the bus by their admission. When pages run out: evict
unreferenced cached pages, at least a share of the pool at a time (`radix_cache.eviction_size`; waiting for copies that
still hold pages, if that frees enough); then, for a decode or for the oldest running request, retract the newest
running request (drop its pages, requeue it at the front; it is recomputed later), passing over a prefill server's
exports whose token is in flight (they end at the next step's result, their pages coming free once their decode
server has taken them or its timeout passed; the request waits for that instead). So the oldest request always
progresses, and admission-time validation guarantees that any one request fits in the pool: no deadlock.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from tandem.config import EngineConfig
from tandem.distributed.parallel import cdiv
from tandem.engine.kv_pool import KVPool
from tandem.engine.observers import IdealReuse
from tandem.engine.radix_cache import Match, RadixCache, eviction_size, lcp
from tandem.engine.request import Request, Status
from tandem.types import FinishReason

PENDING = -1  # a sampled token whose value is still on the device (see model_runner)
PREFETCH_AHEAD = 4  # waiting requests (from the front) whose host pages a step may start prefetching


@dataclass(slots=True)
class Chunk:
    req: Request
    start: int
    num_tokens: int
    sample: bool = False  # it reaches the end of the request's known tokens: sample the next one

    def __post_init__(self):
        self.sample = self.start + self.num_tokens == len(self.req.tokens)


class Scheduler:
    def __init__(self, pool: KVPool, cache: RadixCache | None, config: EngineConfig,
                 eos_token_id: int | None = None, observer: IdealReuse | None = None):
        """`eos_token_id`: ends a request that samples it (unless it ignores EOS). `observer`: told of every
        first admission and every prefix computed (a measurement; the schedule does not depend on it)."""
        self.pool, self.cache, self.config, self.observer = pool, cache, config, observer
        self.eos_token_id = eos_token_id
        self.tier = cache.tier if cache is not None else None
        self.page_size = pool.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; the last is the newest
        self._fruitless_at: int | None = None  # `pool.releases` after the last eviction, if it freed nothing
        self.num_retractions = 0
        self.num_cached_tokens = 0  # tokens served from the prefix cache, over all admissions
        self.num_host_tokens = 0  # of which loaded back from the host tier
        # on first admissions: prompt tokens, and those served from the cache
        self.num_prompt_tokens = self.num_prompt_cached_tokens = 0

    def schedule(self) -> list[Chunk]:
        chunks: list[Chunk] = []
        budget = self.config.max_prefill_tokens
        i = 0
        while i < len(self.running):
            req = self.running[i]
            remaining = len(req.tokens) - req.num_computed
            n = 1 if remaining == 1 else min(remaining, budget)
            if n == 0 or req.num_generated >= req.sampling.max_new_tokens:  # (its last token is still in flight)
                i += 1
                continue
            may_retract = remaining == 1 or i == 0
            while not self._grow(req, req.num_computed + n) and may_retract and (victim := self._victim(req)):
                self.retract(victim)
            n = min(n, len(req.pages) * self.page_size - req.num_computed)
            if n == 0 and remaining == 1 and self.running[-1] is req:  # the newest, no page left: step aside itself
                self.retract(req)
                continue
            if n > 0:
                chunks.append(Chunk(req, req.num_computed, n))
                if remaining > 1:
                    budget -= n
            i += 1
        self._admit(chunks, budget)
        if self.tier is not None:
            self.tier.before_compute()  # the admissions' loads as one copy
        return chunks

    def prefetch(self) -> None:
        """Start the host tier's copies for the first waiting request (of the next few) whose cached prefix is
        partly on the host and not prefetched yet, so that they cross the bus while it waits; one a step, at most
        half the prefetch budget, as the loads of later steps queue behind it. (None while the budget is spent:
        the probes would find no room.) The engine calls it once the step is launched (its host work, and the
        interpreter's lock its copies give up, off the way to the launch), after the step's backups."""
        if self.tier is None or self.tier.prefetch_room <= 0:
            return
        for req in itertools.islice(self.waiting, PREFETCH_AHEAD):
            if req.pages or req.tokens[-1] == PENDING or self.tier.prefetching(req.rid):
                continue
            host = self.cache.match(req.tokens[:-1]).host_pages
            if host and self.tier.prefetch(req.rid, host, max(1, self.tier.prefetch_pages // 2)):
                return

    def _admit(self, chunks: list[Chunk], budget: int) -> None:
        prefilling: dict[tuple[int, ...], list[Request]] = {}  # by first page: only those can share a page
        for c in chunks:
            if c.num_tokens > 1:
                self._note_prefilling(c.req, prefilling)
        # one free page per running request, so admission does not force next step's decodes to retract
        reserve = len(self.running)
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                return
            if req.tokens[-1] == PENDING:  # retracted while its last token is in flight: next step
                continue
            if req.pages:  # imported (prefill/decode): its pages hold its prompt's KV; it decodes its first token
                if not self._grow(req, req.num_computed + 1):
                    return
                self._start(req, chunks, 1)
                budget, reserve = budget - 1, reserve + 1
                continue
            match = self.cache.match(req.tokens[:-1]) if self.cache else Match([])
            if self._better_to_wait(req, match.num_tokens, prefilling):
                continue
            held = [p for p in match.pages if p is not None]
            held += [match.partial_page] if match.partial_page is not None else []
            host = match.host_pages
            self.pool.incref(held)  # eviction below must not take the pages just matched
            if host:
                self.tier.incref(host)
            n, fresh = self._alloc_chunk(req, match, budget, reserve)
            if fresh is None and match.partial_len:
                # holding the partial page costs one page; a request that needs the whole pool recomputes
                # those few tokens instead
                if match.partial_page is not None:
                    self.pool.decref([held.pop()])
                else:
                    self.tier.decref([host.pop()])
                match = match.without_partial(self.page_size)
                n, fresh = self._alloc_chunk(req, match, budget, reserve)
            if fresh is None:
                self.pool.decref(held)
                if host:
                    self.tier.decref(host)
                return  # admit in order: nobody overtakes a request that does not fit
            table = match.pages
            if host:
                table = self.cache.load(match, fresh)
                fresh = fresh[len(match.loads):]
                self.tier.decref(host)
            if self.tier is not None:
                self.tier.retire(req.rid)  # (its load took what it prefetched)
            if match.partial_page is not None:
                if self.tier is not None and self.tier.filling(match.partial_page):
                    self.tier.before_compute()  # (an earlier admission's load fills the page)
                self.pool.copy_slots(match.partial_page, fresh[0], match.partial_len)
                self.pool.decref([match.partial_page])
            req.pages = table + fresh
            req.pages_replaced()
            req.num_computed = match.num_tokens
            if req.num_retractions == 0:  # the first admission: what the prompt as submitted reused
                req.cached_tokens, req.host_cached_tokens = match.num_tokens, self._host_tokens(match)
                self.num_prompt_tokens += len(req.tokens)
                self.num_prompt_cached_tokens += req.cached_tokens
                if self.observer is not None:
                    self.observer.admitted(req.tokens)
            self.num_cached_tokens += match.num_tokens
            self.num_host_tokens += self._host_tokens(match)
            self._start(req, chunks, n)
            self._note_prefilling(req, prefilling)
            budget -= n
            reserve += 1

    def _start(self, req: Request, chunks: list[Chunk], n: int) -> None:
        req.status = Status.RUNNING
        self.waiting.remove(req)
        self.running.append(req)
        chunks.append(Chunk(req, req.num_computed, n))

    def _host_tokens(self, match: Match) -> int:
        return len(match.loads) * self.page_size + (match.partial_len if match.partial_host is not None else 0)

    def _alloc_chunk(self, req: Request, match: Match, budget: int, reserve: int) -> tuple[int, list[int] | None]:
        """The first chunk's length after the cached prefix, and fresh pages for it (None if they do not fit)."""
        n = min(len(req.tokens) - match.num_tokens, budget)
        need = cdiv(match.num_tokens + n, self.page_size) - len(match.pages) + len(match.loads)
        return n, self.alloc(need, reserve)

    def _note_prefilling(self, req: Request, prefilling: dict) -> None:
        if len(req.tokens) >= self.page_size:
            prefilling.setdefault(tuple(req.tokens[:self.page_size]), []).append(req)

    def _better_to_wait(self, req: Request, num_cached: int, prefilling: dict) -> bool:
        """A request sharing a longer prefix with one being prefilled right now (a GRPO sibling, the next
        turn of a running agent) waits for that prefill to land in the cache instead of recomputing it. (It
        would share at least a whole page more than it has cached, so only requests with its first page count.)"""
        if self.cache is None or len(req.tokens) <= self.page_size:
            return False
        limit = len(req.tokens) - 1
        return any(min(lcp(req.tokens, other.tokens), limit) >= num_cached + self.page_size
                   for other in prefilling.get(tuple(req.tokens[:self.page_size]), ()))

    def alloc(self, n: int, reserve: int = 0) -> list[int] | None:
        """n fresh pages, evicting cached ones as needed, keeping `reserve` free; None if they do not fit. (A
        host-tier copy holds pool pages only until its gather, which eviction issues first, or its scatter, which
        admission issues: none is waited for.)"""
        short = n + reserve - self.pool.num_free
        # (no eviction while no page has been released since one that freed nothing: it would free nothing again,
        # and a waiting request that does not fit would walk the whole cache every step for it)
        if short > 0 and self.cache is not None and self._fruitless_at != self.pool.releases \
                and self.cache.evict(eviction_size(short, self.pool)) == 0:
            self._fruitless_at = self.pool.releases
        if self.pool.num_free - reserve < n:
            return None
        return self.pool.alloc(n)

    def _victim(self, req: Request) -> Request | None:
        """Whom to retract so that `req` may grow: the newest running request newer than it, passing over a
        prefill server's exports whose prompt is computed and whose token is in flight (they end at the next
        step's result, their pages exported: retracting one would lose its export, and its pinned pages would not
        come free); None if there is none (`req` then waits)."""
        for other in reversed(self.running):
            if other is req:
                return None
            if other.export_kv_from is None or other.num_generated < other.sampling.max_new_tokens:
                return other
        return None

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Give `req` pages for its first `num_tokens` positions, page by page as far as possible."""
        need = cdiv(num_tokens, self.page_size) - len(req.pages)
        while need > 0:
            page = self.alloc(1)
            if page is None:
                return False
            req.pages += page
            need -= 1
        return True

    def advance(self, chunks: list[Chunk]) -> int:
        """The bookkeeping of a step launched over `chunks`: their tokens count as computed, each sampling chunk's
        request gets a `PENDING` token (`pending_row`: its index among the step's samples, in chunk order) that
        `resolve` fills in, and fresh prefixes go to the cache. Returns the prefill tokens the step computes."""
        num_prefill = num_samples = 0
        for c in chunks:
            req = c.req
            req.num_computed += c.num_tokens
            if c.num_tokens > 1 or req.num_generated == 0:
                req.prefill_tokens += c.num_tokens
                num_prefill += c.num_tokens
            if c.sample:
                req.tokens.append(PENDING)
                req.pending_row, num_samples = num_samples, num_samples + 1
        self._publish_prefixes(chunks)
        return num_prefill

    def resolve(self, req: Request, index: int, token: int, logprob: float, version: int,
                top: list[tuple[float, int]] | None = None) -> FinishReason | None:
        """Fill in the sampled token at `index` (the request's oldest `PENDING` one), sampled under weight
        `version` (`top`: its distribution's most likely tokens, kept when the request asks for them); returns why
        the request ends there (a stop or EOS token, `max_new_tokens`), or None."""
        assert req.tokens[index] == PENDING, "sampled tokens resolve in order"
        req.tokens[index] = token
        req.output_logprobs.append(logprob)
        req.weight_versions.append(version)
        sp = req.sampling
        if sp.top_logprobs_num:
            if req.output_top_logprobs is None:  # (outputs before this one, a continuation's: none known)
                req.output_top_logprobs = [[] for _ in range(index - req.prompt_len)]
            req.output_top_logprobs.append(top[:sp.top_logprobs_num] if top is not None else [])
        generated = index + 1 - req.prompt_len  # resolved so far (the next one may already be in flight)
        if token in sp.stop_token_ids or (not sp.ignore_eos and token == self.eos_token_id):
            return FinishReason("stop", matched=token)
        if generated >= sp.max_new_tokens:
            return FinishReason("length", length=generated)
        return None

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request for good: a token sampled after the one that ended it (still in flight) is dropped, its
        pages go (its KV to the cache), and it leaves the queues."""
        if PENDING in req.tokens:
            del req.tokens[req.tokens.index(PENDING):]
            req.num_computed = min(req.num_computed, len(req.tokens))
        self.remove(req)
        req.finish_reason = reason

    def _publish_prefixes(self, chunks: list[Chunk]) -> None:
        """Publish freshly prefilled prefixes to the cache so that waiting siblings can share them."""
        if self.cache is None:
            return
        for c in chunks:
            req = c.req
            if c.num_tokens > 1 and req.status is Status.RUNNING and not req.kv_stale:
                self.cache.adopt(req.pages, self.cache.insert(req.tokens[:req.num_computed], req.pages))
                req.pages_replaced()
                if self.observer is not None:
                    self.observer.computed(req.tokens[:req.num_computed])

    def release(self, req: Request) -> None:
        """Drop the request's pages; its computed KV stays in the cache unless it is stale."""
        if req.pages:
            if self.cache is not None and not req.kv_stale and req.num_computed:
                self.cache.insert(req.tokens[:req.num_computed], req.pages)
                if self.observer is not None:
                    self.observer.computed(req.tokens[:req.num_computed])
            self.pool.decref(req.pages)
        req.pages, req.num_computed = [], 0
        req.pages_replaced()

    def retract(self, req: Request) -> None:
        self.release(req)
        self.running.remove(req)
        req.status = Status.WAITING
        req.kv_stale = False
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    def remove(self, req: Request) -> None:
        """Take a request out for good (finished or aborted)."""
        if self.tier is not None:
            self.tier.retire(req.rid)
        self.release(req)
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
