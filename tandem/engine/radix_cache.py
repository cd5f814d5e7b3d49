"""Radix prefix cache over KV pages.

The tree maps token sequences to the pages holding their KV. Matching is token-exact; sharing is by
page: a request takes whole matched pages by reference and copies the matched part of a partially
matched page into a page of its own (pages others read are never written). Node boundaries sit on page
boundaries; only a leaf may end inside a page.

The tree holds one reference on every page it names; eviction trims least-recently-used leaves from
their tails, and only pages nobody else references (refcount 1), so running requests keep their prefix.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from tandem.engine.kv_pool import KVPool


class Node:
    __slots__ = ("tokens", "pages", "children", "parent", "last_access")

    def __init__(self, tokens: list[int], pages: list[int], parent: Node | None):
        self.tokens, self.pages, self.parent = tokens, pages, parent
        self.children: list[Node] = []
        self.last_access = 0


@dataclass(slots=True)
class Match:
    pages: list[int]  # fully matched pages, in order
    partial_page: int | None = None  # page whose first `partial_len` tokens also match
    partial_len: int = 0
    num_tokens: int = 0


def lcp(a: list[int], b: list[int]) -> int:
    """Length of the common prefix (binary search over slice equality, which runs in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixCache:
    def __init__(self, pool: KVPool):
        self.pool, self.P = pool, pool.page_size
        self.root = Node([], [], None)
        self._clock = itertools.count(1)

    # -- lookups -------------------------------------------------------------------------------------
    def _best_child(self, node: Node, q: list[int]) -> tuple[Node | None, int]:
        best, best_len = None, 0
        for child in node.children:
            c = lcp(child.tokens[:self.P], q)
            if c > best_len or (c == best_len and best is not None and len(child.tokens) < len(best.tokens)):
                best, best_len = child, c
        return best, best_len

    def match(self, tokens: list[int]) -> Match:
        """The longest cached prefix of `tokens`. Marks the path as recently used; takes no references."""
        P, now = self.P, next(self._clock)
        node, i, full = self.root, 0, []
        while i < len(tokens):
            node, c = self._best_child(node, tokens[i:i + P])
            if node is None:
                break
            node.last_access = now
            for j, page in enumerate(node.pages):
                c = lcp(node.tokens[j * P:(j + 1) * P], tokens[i:i + P])
                if c == P:
                    full.append(page)
                    i += P
                    continue
                return Match(full, page if c else None, c, len(full) * P + c)
        return Match(full, num_tokens=len(full) * P)

    # -- inserts -------------------------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        """Record that `pages` (a sequence's page table) hold the KV of `tokens`. The tree takes its own
        references on pages it adopts; where it already holds the same content it keeps its page. Returns the
        tree's pages for the leading full pages it already held: a caller still running should switch to
        them (`RadixCache.adopt`), or its duplicates would sit under the tree's copies and pin them."""
        P, now = self.P, next(self._clock)
        n = len(tokens)
        pages = pages[:-(-n // P)]
        node, i, held = self.root, 0, []
        while i < n:
            child, c = self._best_child(node, tokens[i:i + P])
            if child is None:
                self._add_child(node, tokens[i:], pages[i // P:], now)
                return held
            child.last_access = now
            for j in range(len(child.pages)):
                seg, q = child.tokens[j * P:(j + 1) * P], tokens[i:i + P]
                c = lcp(seg, q)
                if c == len(seg) == len(q):
                    if len(q) == P:
                        held.append(child.pages[j])
                    i += len(q)
                    continue
                if c == len(seg) < len(q):  # a partial last page, extended: the longer copy replaces it
                    self._extend_leaf(child, j, tokens[i:], pages[i // P:])
                elif c < len(q):  # diverges inside this page (else q is a prefix of it: already covered)
                    parent = node if j == 0 else self._split(child, j)
                    self._add_child(parent, tokens[i:], pages[i // P:], now)
                return held
            node = child
        return held

    def adopt(self, pages: list[int], held: list[int]) -> None:
        """Switch a running sequence's page table to the tree's copies of its leading full pages (same
        content), dropping its own duplicates. Full pages only: a partial page is still being written."""
        for j, page in enumerate(held):
            if pages[j] != page:
                self.pool.incref([page])
                self.pool.decref([pages[j]])
                pages[j] = page

    def _add_child(self, parent: Node, tokens, pages, now):
        self.pool.incref(pages)
        child = Node(list(tokens), list(pages), parent)
        child.last_access = now
        parent.children.append(child)

    def _extend_leaf(self, leaf: Node, j: int, tokens, pages):
        assert not leaf.children and j == len(leaf.pages) - 1, "only a leaf's last page may be partial"
        self.pool.incref(pages)
        self.pool.decref([leaf.pages[j]])
        leaf.tokens = leaf.tokens[:j * self.P] + list(tokens)
        leaf.pages = leaf.pages[:j] + list(pages)

    def _split(self, child: Node, j: int) -> Node:
        """Cut `child` before its page j; the new upper node is returned."""
        upper = Node(child.tokens[:j * self.P], child.pages[:j], child.parent)
        upper.last_access = child.last_access
        siblings = child.parent.children
        siblings[siblings.index(child)] = upper
        child.tokens, child.pages, child.parent = child.tokens[j * self.P:], child.pages[j:], upper
        upper.children.append(child)
        return upper

    # -- eviction and flush --------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages held only by the tree, least recently used leaves first, trimming
        each from its tail. Returns how many were freed."""
        refcount, freed = self.pool.refcount, 0
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        while heap and freed < num_pages:
            _, _, leaf = heapq.heappop(heap)
            while leaf.pages and refcount[leaf.pages[-1]] == 1 and freed < num_pages:
                self.pool.decref([leaf.pages.pop()])
                leaf.tokens = leaf.tokens[:len(leaf.pages) * self.P]
                freed += 1
            if not leaf.pages:
                parent = leaf.parent
                parent.children.remove(leaf)
                if parent is not self.root and not parent.children:
                    heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Forget everything (after a weight update, its KV is stale). Pages still referenced by running
        requests stay alive with them; the rest return to the pool."""
        for node in self._nodes():
            self.pool.decref(node.pages)
        self.root = Node([], [], None)

    def _nodes(self):
        stack = list(self.root.children)
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            yield node

    def _leaves(self):
        return [n for n in self._nodes() if not n.children]

    @property
    def num_pages(self) -> int:
        return sum(len(n.pages) for n in self._nodes())

    def check_invariants(self) -> None:
        """For tests: the tree's shape rules and its references."""
        P, seen = self.P, set()
        for node in self._nodes():
            assert node.pages, "empty node"
            assert node.parent is not None and node in node.parent.children
            if node.children:
                assert len(node.tokens) == len(node.pages) * P, "internal node ends inside a page"
            else:
                assert (len(node.pages) - 1) * P < len(node.tokens) <= len(node.pages) * P
            for p in node.pages:
                assert self.pool.refcount[p] >= 1, f"tree names free page {p}"
                assert p not in seen, f"page {p} named twice"
                seen.add(p)
