"""The radix prefix cache over a real KV pool: token-exact matches, page sharing and copying, eviction, and a
stateful model of requests that checks references and the KV data itself after every step.

Each computed token writes a recognisable value into its KV slot: the key holds token + 1000 * position, the
value a digest of the whole prefix. A page reused while still referenced, pages in the wrong order, or KV
from another context then shows up as a wrong value, not only as a wrong count.
"""

import zlib
from dataclasses import dataclass, field

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tandem.config import PRESETS
from tandem.engine.kv_pool import KVPool
from tandem.engine.radix_cache import Match, RadixCache

P = 4


def kv_value(tokens: list[int], pos: int) -> tuple[float, float]:
    return float(tokens[pos] + 1 + 1000 * pos), float(zlib.crc32(repr(tokens[:pos + 1]).encode()) % (1 << 23))


def make(num_pages=16) -> tuple[KVPool, RadixCache]:
    pool = KVPool(PRESETS["tiny"], num_pages, P, torch.float32, "cpu")
    return pool, RadixCache(pool)


def write(pool: KVPool, pages: list[int], tokens: list[int], start: int, end: int) -> None:
    """Play the model: compute the KV of positions [start, end) into the page table."""
    for pos in range(start, end):
        slot = pages[pos // P] * P + pos % P
        pool.k_cache[0, slot, 0, 0], pool.v_cache[0, slot, 0, 0] = kv_value(tokens, pos)


def holds(pool: KVPool, pages: list[int], tokens: list[int], num_tokens: int | None = None) -> bool:
    """Whether the page table holds the KV of the first `num_tokens` of `tokens`."""
    n = len(tokens) if num_tokens is None else num_tokens
    if n == 0:
        return True
    slots = pool.slots(pages, 0, n)
    k, v = pool.k_cache[0, slots, 0, 0].tolist(), pool.v_cache[0, slots, 0, 0].tolist()
    return all((k[pos], v[pos]) == kv_value(tokens, pos) for pos in range(n))


def table(m: Match) -> list[int]:
    """The pages a match names, the partially matched one last."""
    return m.pages + ([m.partial_page] if m.partial_page is not None else [])


def compute(pool: KVPool, tokens: list[int]) -> list[int]:
    """A request that computed `tokens` from scratch: fresh pages (one reference each) holding their KV."""
    pages = pool.alloc(-(-len(tokens) // P))
    write(pool, pages, tokens, 0, len(tokens))
    return pages


def cache_and_release(pool: KVPool, cache: RadixCache, tokens: list[int], pages: list[int]) -> None:
    cache.insert(tokens, pages)
    pool.decref(pages)


def admit(pool: KVPool, cache: RadixCache, tokens: list[int]) -> list[int]:
    """A request that reuses the cache as the scheduler does: whole matched pages by reference, the partially
    matched page copied into a fresh page, the rest computed."""
    m = cache.match(tokens)
    held = table(m)
    pool.incref(held)
    fresh = pool.alloc(-(-len(tokens) // P) - len(m.pages))
    if m.partial_page is not None:
        pool.copy_slots(m.partial_page, fresh[0], m.partial_len)
        pool.decref([m.partial_page])
    pages = m.pages + fresh
    write(pool, pages, tokens, m.num_tokens, len(tokens))
    return pages


A = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # pages: [1 2 3 4] [5 6 7 8] [9 10 . .]


def test_match_after_insert_is_token_exact():
    pool, cache = make()
    pages = compute(pool, A)
    cache_and_release(pool, cache, A, pages)
    for query, num_full, partial_len in [
        (A, 2, 2), (A + [11, 12], 2, 2), (A[:8], 2, 0), (A[:7], 1, 3), (A[:5] + [99], 1, 1), (A[:4], 1, 0),
        ([1, 2, 99], 0, 2), ([99] + A, 0, 0), ([], 0, 0),
    ]:
        m = cache.match(query)
        assert (m.pages, m.num_tokens, m.partial_len) == (pages[:num_full], num_full * P + partial_len, partial_len)
        assert m.partial_page == (pages[num_full] if partial_len else None)
    cache.check_invariants()


def test_a_partial_match_copied_into_a_fresh_page_holds_the_cached_kv():
    pool, cache = make()
    cache_and_release(pool, cache, A, compute(pool, A))
    b = A[:6] + [70, 71, 72]  # diverges inside page 1
    pages = admit(pool, cache, b)
    assert holds(pool, pages, b)
    assert holds(pool, table(cache.match(A)), A)  # the cached page is untouched
    assert pool.refcount[pages[0]] == 2 and pool.refcount[pages[1]] == 1


def test_inserting_an_extension_of_a_partial_leaf_replaces_its_last_page():
    pool, cache = make()
    a_pages = compute(pool, A)
    cache_and_release(pool, cache, A, a_pages)
    b = A + [11, 12, 13]  # shares A's partial page 2 and extends it
    b_pages = admit(pool, cache, b)
    assert b_pages[:2] == a_pages[:2] and b_pages[2] != a_pages[2]
    cache_and_release(pool, cache, b, b_pages)
    cache.check_invariants()
    m = cache.match(b)
    assert m.pages == b_pages[:3] and m.partial_page == b_pages[3] and m.num_tokens == len(b)
    assert pool.refcount[a_pages[2]] == 0 and a_pages[2] in pool._free  # the shorter copy went back
    assert cache.num_pages == 4 and pool.num_free == 16 - 4


def test_a_replaced_partial_page_stays_alive_while_another_request_holds_it():
    pool, cache = make()
    a_pages = compute(pool, A)
    cache.insert(A, a_pages)  # published mid-flight, as after a prefill chunk: the request keeps its pages
    b = A + [11]
    cache_and_release(pool, cache, b, admit(pool, cache, b))
    assert pool.refcount[a_pages[2]] == 1 and a_pages[2] not in pool._free
    write(pool, a_pages, A + [50], 10, 11)  # the first request goes on writing into its own page
    assert holds(pool, table(cache.match(b)), b)
    cache.check_invariants()


def test_diverging_at_a_page_boundary_splits_the_node():
    pool, cache = make()
    a = A + [11, 12]  # three full pages
    a_pages = compute(pool, a)
    cache_and_release(pool, cache, a, a_pages)
    b = a[:8] + [20, 21, 22]
    b_pages = admit(pool, cache, b)
    cache_and_release(pool, cache, b, b_pages)
    cache.check_invariants()
    [upper] = cache.root.children
    assert upper.tokens == a[:8] and upper.pages == a_pages[:2]
    assert sorted(c.tokens for c in upper.children) == [[9, 10, 11, 12], [20, 21, 22]]
    for seq in (a, b):
        m = cache.match(seq)
        assert m.num_tokens == len(seq) and holds(pool, table(m), seq)


def test_siblings_diverging_inside_a_page_each_keep_their_own_page():
    pool, cache = make()
    a, b = [1, 2, 3, 4, 5], [1, 2, 9, 9, 9]
    cache_and_release(pool, cache, a, compute(pool, a))
    cache_and_release(pool, cache, b, admit(pool, cache, b))
    cache.check_invariants()
    assert len(cache.root.children) == 2 and cache.num_pages == 4
    for seq in (a, b):
        m = cache.match(seq)
        assert m.num_tokens == 5 and holds(pool, table(m), seq)
    m = cache.match([1, 2, 7])
    assert m.num_tokens == 2 and m.partial_len == 2 and not m.pages
    # extending one sibling's partial last page does not touch the other
    c = a + [6, 7, 8, 9]
    cache_and_release(pool, cache, c, admit(pool, cache, c))
    cache.check_invariants()
    assert cache.match(b).num_tokens == 5 and cache.match(c).num_tokens == 9


def test_inserting_what_the_tree_already_holds_adopts_no_page():
    pool, cache = make()
    a_pages = compute(pool, A)
    cache_and_release(pool, cache, A, a_pages)
    other = compute(pool, A)  # the same tokens computed again, into other pages
    cache.insert(A[:6], other)  # a covered prefix
    cache.insert(A, other)  # the same content
    assert all(pool.refcount[p] == 1 for p in other)  # held by their request only
    assert cache.num_pages == 3 and table(cache.match(A)) == a_pages


def test_eviction_trims_least_recently_used_leaves_from_their_tails():
    pool, cache = make()
    a, b = A + [11, 12], [50, 51, 52, 53, 54, 55, 56, 57, 58]
    cache_and_release(pool, cache, a, compute(pool, a))
    cache_and_release(pool, cache, b, compute(pool, b))
    cache.match(a)  # a is now more recently used than b
    assert cache.evict(2) == 2
    cache.check_invariants()
    assert cache.match(b).num_tokens == 4 and cache.match(a).num_tokens == 12  # b lost its last two pages
    assert cache.evict(2) == 2
    assert cache.match(b).num_tokens == 0 and cache.match(a).num_tokens == 8
    assert pool.num_free == 16 - 2


def test_eviction_empties_internal_nodes_once_their_children_are_gone():
    pool, cache = make()
    a = A + [11, 12]
    for seq in (a, a[:8] + [20], a[:4] + [30, 31, 32, 33, 34]):
        cache_and_release(pool, cache, seq, admit(pool, cache, seq))
    cache.check_invariants()
    assert cache.num_pages == 6 and len(cache.root.children) == 1  # [a0] -> {[a1] -> {[a2], [20]}, [30..34]}
    assert cache.evict(100) == 6 and cache.num_pages == 0 and pool.num_free == 16
    assert cache.root.children == []


def test_eviction_never_frees_a_page_another_holder_references():
    pool, cache = make()
    a = A + [11, 12]
    a_pages = compute(pool, a)
    cache_and_release(pool, cache, a, a_pages)
    holder = cache.match(a[:8]).pages  # a request holding the first two pages
    pool.incref(holder)
    assert cache.evict(100) == 1  # only the unreferenced tail page
    assert cache.match(a).num_tokens == 8 and holds(pool, holder, a, 8)
    pool.decref(holder)
    assert cache.evict(100) == 2 and pool.num_free == 16


def test_eviction_stops_at_a_referenced_tail_page():
    pool, cache = make()
    a = A + [11, 12]
    a_pages = compute(pool, a)
    cache_and_release(pool, cache, a, a_pages)
    pool.incref([a_pages[2]])  # someone holds the last page only: the ones before it cannot be trimmed
    assert cache.evict(100) == 0 and cache.num_pages == 3
    assert holds(pool, a_pages, a)


def test_reset_forgets_everything_but_pages_held_by_requests_stay_alive():
    pool, cache = make()
    a = A + [11, 12]
    running = compute(pool, a)
    cache.insert(a, running)  # still running: holds its pages
    b = [40, 41, 42, 43, 44]
    cache_and_release(pool, cache, b, compute(pool, b))
    cache.reset()
    cache.check_invariants()
    assert cache.num_pages == 0 and cache.match(a).num_tokens == 0 and cache.match(b).num_tokens == 0
    assert all(pool.refcount[p] == 1 for p in running) and pool.num_free == 16 - 3
    assert holds(pool, running, a)
    pool.decref(running)
    assert pool.num_free == 16


def test_insert_returns_the_trees_copies_of_the_leading_full_pages():
    pool, cache = make()
    a_pages = compute(pool, A)
    cache_and_release(pool, cache, A, a_pages)
    b = A[:9] + [30, 31, 32, 33, 34]  # computed separately: its first two pages duplicate the tree's
    b_pages = compute(pool, b)
    assert cache.insert(b, b_pages) == a_pages[:2]
    assert cache.insert(A[:6], b_pages) == a_pages[:1]
    # never a partial page, even one with the same tokens: its holder is still writing into it
    assert cache.insert(A, compute(pool, A)) == a_pages[:2]


def test_adopting_the_trees_copies_frees_the_duplicates_and_pins_nothing():
    pool, cache = make()
    a = A[:8]
    cache_and_release(pool, cache, a, compute(pool, a))
    b = a + [20, 21, 22, 23, 24]
    b_pages = compute(pool, b)  # running: the tree's copies of pages 0-1 are not referenced by it
    own = list(b_pages)
    cache.adopt(b_pages, cache.insert(b, b_pages))
    assert b_pages[:2] == table(cache.match(a)) and b_pages[2:] == own[2:]
    assert pool.refcount[own[0]] == pool.refcount[own[1]] == 0
    assert holds(pool, b_pages, b)
    cache.evict(100)  # the request's own page 2 hangs below the tree's pages 0-1: they stay, held by it
    assert pool.num_free == 16 - len(b_pages)


# -- a stateful model of requests over the cache ------------------------------------------------------------

def tree_paths(cache: RadixCache) -> list[tuple[list[int], list[int]]]:
    """(tokens, page table) from the root to every node."""
    paths, stack = [], [(child, [], []) for child in cache.root.children]
    while stack:
        node, tokens, pages = stack.pop()
        tokens, pages = tokens + node.tokens, pages + node.pages
        paths.append((tokens, pages))
        stack += [(child, tokens, pages) for child in node.children]
    return paths


def pinned_pages(cache: RadixCache) -> list[int]:
    """Tree pages that only the tree references but that `evict` cannot reach: it trims leaves from their
    tails and removes a node only once its children are gone, so a page above a referenced one stays."""
    refcount = cache.pool.refcount

    def visit(node) -> tuple[bool, list[int]]:  # (the whole subtree can go, pinned pages in it)
        results = [visit(c) for c in node.children]
        pinned = [p for _, ps in results for p in ps]
        tail_free = all(gone for gone, _ in results)
        for p in reversed(node.pages):
            tail_free = tail_free and refcount[p] == 1
            if refcount[p] == 1 and not tail_free:
                pinned.append(p)
        return tail_free, pinned

    return sorted(p for c in cache.root.children for p in visit(c)[1])


NUM_PAGES = 10
# Three symbols, and prefixes of base sequences that share 6 and 9 tokens: prefixes collide often, inside pages
# and at page boundaries, and diverge inside multi-page nodes.
BASES = ([0, 1, 2, 0, 2, 1, 1, 0, 2, 2, 0, 1, 0, 2], [0, 1, 2, 0, 2, 1, 0, 0, 1, 2, 1, 1, 2, 0],
         [0, 1, 2, 0, 2, 1, 1, 0, 2, 0, 0, 2, 1, 1])
symbols = st.lists(st.integers(0, 2), max_size=4)
from_a_base = st.builds(lambda base, k, tail: (base[:k] + tail) or [0], st.sampled_from(BASES), st.integers(0, 14),
                        symbols)
tokens_strategy = st.one_of(from_a_base, from_a_base, from_a_base, st.lists(st.integers(0, 2), min_size=1, max_size=14))


def extend_request(machine, i: int, more: list[int]) -> None:
    """A request of a state machine (`requests`, `pool`, `_alloc`) decodes `more` tokens, if pages allow."""
    req = machine.requests[i % len(machine.requests)]
    n = len(req.tokens) + len(more)
    fresh = machine._alloc(-(-n // P) - len(req.pages))
    if fresh is None:
        return
    req.pages += fresh
    req.tokens += more
    write(machine.pool, req.pages, req.tokens, n - len(more), n)


@dataclass
class Req:
    tokens: list[int]
    pages: list[int] = field(default_factory=list)


class CacheModel(RuleBasedStateMachine):
    """Requests admit (match, share, copy, compute), extend, publish mid-flight, release with or without caching
    their KV; the cache evicts and resets. After every step references and KV data are checked."""

    @initialize()
    def start(self):
        self.pool, self.cache = make(NUM_PAGES)
        self.requests: list[Req] = []
        self.probes: list[list[int]] = []

    def _alloc(self, n: int) -> list[int] | None:
        if n > self.pool.num_free:
            self.cache.evict(n - self.pool.num_free)
        return self.pool.alloc(n)

    @rule(tokens=tokens_strategy)
    def admit(self, tokens):
        self.probes.append(tokens)
        m = self.cache.match(tokens)
        held = table(m)
        self.pool.incref(held)
        fresh = self._alloc(-(-len(tokens) // P) - len(m.pages))
        if fresh is None:
            self.pool.decref(held)
            return
        if m.partial_page is not None:
            self.pool.copy_slots(m.partial_page, fresh[0], m.partial_len)
            self.pool.decref([m.partial_page])
        req = Req(list(tokens), m.pages + fresh)
        write(self.pool, req.pages, req.tokens, m.num_tokens, len(tokens))
        self.requests.append(req)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100), more=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def extend(self, i, more):
        extend_request(self, i, more)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100))
    def publish(self, i):
        """Mid-flight, as after a prefill chunk: the request switches to the tree's copies of its full pages."""
        req = self.requests[i % len(self.requests)]
        self.cache.adopt(req.pages, self.cache.insert(req.tokens, req.pages))
        self.probes.append(list(req.tokens))

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100), keep=st.booleans())
    def release(self, i, keep):
        req = self.requests.pop(i % len(self.requests))
        if keep:
            self.cache.insert(req.tokens, req.pages)
        self.pool.decref(req.pages)

    @rule(n=st.integers(1, NUM_PAGES))
    def evict(self, n):
        before = self.pool.num_free
        freed = self.cache.evict(n)
        assert freed <= n and self.pool.num_free == before + freed

    @rule()
    def evict_everything(self):
        self.cache.evict(NUM_PAGES)
        held = {p for req in self.requests for p in req.pages}
        assert self.pool.num_free == NUM_PAGES - len(held), "a page no request holds survived eviction"

    @rule()
    def reset(self):
        self.cache.reset()
        assert self.cache.num_pages == 0

    @invariant()
    def references_match_holders(self):
        self.cache.check_invariants()
        expected = [0] * NUM_PAGES
        for node in self.cache._nodes():
            for p in node.pages:
                expected[p] += 1
        for req in self.requests:
            assert len(set(req.pages)) == len(req.pages) == -(-len(req.tokens) // P)
            for p in req.pages:
                expected[p] += 1
        assert self.pool.refcount == expected
        free = self.pool._free
        assert len(set(free)) == len(free) and sorted(free) == [p for p, n in enumerate(expected) if n == 0]

    @invariant()
    def no_page_is_pinned(self):
        """Every tree page no request holds could be evicted: none sits above a page a request holds."""
        assert pinned_pages(self.cache) == []

    @invariant()
    def every_holder_reads_its_own_kv(self):
        for req in self.requests:
            assert holds(self.pool, req.pages, req.tokens)
        for tokens, pages in tree_paths(self.cache):
            assert holds(self.pool, pages, tokens), f"tree KV wrong along {tokens}"

    @invariant()
    def matches_are_the_longest_cached_prefix_with_its_kv(self):
        cached = {tuple(tokens[:k]) for tokens, _ in tree_paths(self.cache) for k in range(len(tokens) + 1)}
        for seq in self.probes[-8:] + [r.tokens for r in self.requests]:
            m = self.cache.match(seq)
            longest = max(k for k in range(len(seq) + 1) if tuple(seq[:k]) in cached or k == 0)
            assert m.num_tokens == longest == len(m.pages) * P + m.partial_len
            assert (m.partial_page is not None) == (m.partial_len > 0)
            assert holds(self.pool, table(m), seq, m.num_tokens)


CacheModel.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None, derandomize=True)
test_cache_model = CacheModel.TestCase
