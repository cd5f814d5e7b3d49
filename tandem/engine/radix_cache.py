"""Radix prefix cache over KV pages, with an optional host tier under it.

The tree maps token sequences to the pages holding their KV. Matching is token-exact; sharing is by
page: a request takes whole matched pages by reference and copies the matched part of a partially
matched page into a page of its own (pages others read are never written). Node boundaries sit on page
boundaries; only a leaf may end inside a page.

The tree holds one reference on every page it names; eviction trims least-recently-used leaves from
their tails, and only pages nobody else references (refcount 1), so running requests keep their prefix.

With a host tier (`tandem.engine.host_tier`) each full page of a node may also have a host copy: backed up
when the tree takes it (write_through) or when it is evicted (write_back). Evicting a device page whose
content is on the host keeps the node; a later match returns that page as a load, and the caller copies it
back into a fresh device page instead of recomputing it. Every page of a node is on the device, on the host
or both.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from tandem.distributed.parallel import cdiv
from tandem.engine.host_tier import HostTier
from tandem.engine.kv_pool import KVPool, PageAllocator

# An eviction asked for fewer pages frees this share of its pool (`eviction_size`): each walks the whole tree, and
# steps take pages (and back them up) a few at a time (BENCHMARKS.md, "Schedule cost")
EVICT_FRACTION = 1 / 256


def eviction_size(short: int, pool: PageAllocator) -> int:
    """How many pages to evict from `pool` (the device's, or the host tier's) when it is `short` of free ones: at
    least `EVICT_FRACTION` of it, so that one walk of the tree serves many allocations or backups."""
    return max(short, int(pool.num_pages * EVICT_FRACTION))


class Node:
    __slots__ = ("tokens", "pages", "host", "children", "by_first", "key", "parent", "last_access")

    def __init__(self, tokens: list[int], pages: list, host: list, parent: Node | None):
        self.tokens, self.parent = tokens, parent
        self.pages: list[int | None] = pages  # device page of each page of tokens, None if only on the host
        self.host: list[int | None] = host  # host copy of each page, None if none
        self.children: list[Node] = []
        self.by_first: dict[int, list[Node]] = {}  # the children by their first token: what a lookup scans
        self.key = tokens[0] if tokens else None  # its first token, as its parent indexes it
        self.last_access = 0

    def add_child(self, child: Node) -> None:
        child.key = child.tokens[0]
        self.children.append(child)
        self.by_first.setdefault(child.key, []).append(child)

    def remove_child(self, child: Node) -> None:
        self.children.remove(child)
        same = self.by_first[child.key]
        same.remove(child)
        if not same:
            del self.by_first[child.key]

    def replace_child(self, old: Node, new: Node) -> None:
        """`new` takes `old`'s place (same first token)."""
        self.children[self.children.index(old)] = new
        same = self.by_first[old.key]
        same[same.index(old)] = new
        new.key = old.key

    def clear_children(self) -> None:
        self.children, self.by_first = [], {}


@dataclass(slots=True)
class Match:
    pages: list[int | None]  # fully matched pages, in order; None where the page is on the host only
    partial_page: int | None = None  # device page whose first `partial_len` tokens also match
    partial_host: int | None = None  # or, if that page is on the host only, its host copy
    partial_len: int = 0
    num_tokens: int = 0
    loads: list[tuple[Node, int]] = field(default_factory=list)  # (node, index) of each None in `pages`

    @property
    def host_pages(self) -> list[int]:
        """Every host page the match needs loaded, the partially matched one last."""
        return [node.host[j] for node, j in self.loads] + ([self.partial_host] if self.partial_host is not None
                                                            else [])

    def without_partial(self, page_size: int) -> Match:
        return Match(self.pages, num_tokens=len(self.pages) * page_size, loads=self.loads)


def lcp(a: list[int], b: list[int]) -> int:
    """Length of the common prefix (binary search over slice equality, which runs in C)."""
    n = min(len(a), len(b))
    if (a if len(a) == n else a[:n]) == (b if len(b) == n else b[:n]):  # (no copy of a list already n long)
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
    def __init__(self, pool: KVPool | PageAllocator, tier: HostTier | None = None):
        self.pool, self.tier, self.P = pool, tier, pool.page_size
        self.root = Node([], [], [], None)
        self._clock = itertools.count(1)

    # -- lookups -------------------------------------------------------------------------------------
    def _best_child(self, node: Node, tokens: list[int], i: int) -> Node | None:
        """The child whose first page shares the longest prefix with the page of `tokens` from position i (on a
        tie the shorter child), or None if no child starts with token i."""
        same = node.by_first.get(tokens[i])
        if not same:  # a child with another first token matches nothing
            return None
        if len(same) == 1:  # (the usual case: it shares at least that token, so it is the best)
            return same[0]
        best, best_len, q = None, 0, tokens[i:i + self.P]
        for child in same:
            c = lcp(child.tokens[:self.P], q)
            if c > best_len or (c == best_len and best is not None and len(child.tokens) < len(best.tokens)):
                best, best_len = child, c
        return best

    def match(self, tokens: list[int]) -> Match:
        """The longest cached prefix of `tokens`. Marks the path as recently used; takes no references."""
        P, now = self.P, next(self._clock)
        node, i, m = self.root, 0, Match([])
        while i < len(tokens):
            node = self._best_child(node, tokens, i)
            if node is None:
                break
            node.last_access = now
            # the node's tokens against the query at once (one comparison, not one a page: under a host tier a
            # match runs the whole history, dozens of pages); only a leaf's last page may be shorter than P
            c = lcp(node.tokens, tokens[i:i + len(node.tokens)])
            full = c // P
            m.loads += [(node, j) for j in range(full) if node.pages[j] is None]
            m.pages += node.pages[:full]
            i += full * P
            if full < len(node.pages):  # it stops inside this node: a partial page, if any of it matches
                m.partial_len = c - full * P
                if m.partial_len:
                    if node.pages[full] is not None:
                        m.partial_page = node.pages[full]
                    else:
                        m.partial_host = node.host[full]
                m.num_tokens = len(m.pages) * P + m.partial_len
                return m
        m.num_tokens = len(m.pages) * P
        return m

    def load(self, match: Match, fresh: list[int]) -> list[int]:
        """Bring the match's host-only pages back into the caller's fresh pages, in order: each full page into
        one the tree shares too, the partially matched one (if any) into the next, the caller's own. Returns
        the match's page table with the full pages filled in. Nothing may read them before the tier's
        `before_compute` (the loads' scatter)."""
        host = match.host_pages
        self.tier.load(host, fresh[:len(host)])  # (the caller runs `tier.before_compute` before reading them)
        self.pool.mark_unsummed(fresh[:len(host)])  # (no checksum records came with them)
        shared = fresh[:len(match.loads)]
        self.pool.incref(shared)
        for (node, j), page in zip(match.loads, shared, strict=True):
            node.pages[j] = page
        fill = iter(shared)
        return [p if p is not None else next(fill) for p in match.pages]

    # -- inserts -------------------------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        """Record that `pages` (a sequence's page table) hold the KV of `tokens`. The tree takes its own
        references on pages it adopts; where it already holds the same content it keeps its page. Returns the
        tree's pages for the leading full pages it already held: a caller still running should switch to
        them (`RadixCache.adopt`), or its duplicates would sit under the tree's copies and pin them."""
        P, now = self.P, next(self._clock)
        n = len(tokens)
        pages = pages[:cdiv(n, P)]
        node, i, held = self.root, 0, []
        while i < n:
            child = self._best_child(node, tokens, i)
            if child is None:
                self._add_child(node, tokens[i:], pages[i // P:], now)
                return held
            child.last_access = now
            # its leading full pages equal to the query's, found by one comparison (a host tier keeps whole
            # histories in the tree: an insert walks dozens of pages); the page where they part goes below
            same = lcp(child.tokens, tokens[i:i + len(child.tokens)]) // P
            for j in range(same):
                if child.pages[j] is None:  # only on the host: the caller's page is its device copy
                    child.pages[j] = pages[i // P]
                    self.pool.incref([child.pages[j]])
                held.append(child.pages[j])
                i += P
            for j in range(same, len(child.pages)):
                seg, q = child.tokens[j * P:(j + 1) * P], tokens[i:i + P]
                c = lcp(seg, q)
                if c == len(seg) == len(q):
                    if len(q) == P:
                        if child.pages[j] is None:  # only on the host: the caller's page is its device copy
                            child.pages[j] = pages[i // P]
                            self.pool.incref([child.pages[j]])
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
        child = Node(list(tokens), list(pages), [None] * len(pages), parent)
        child.last_access = now
        parent.add_child(child)
        self._write_through(child, 0)

    def _extend_leaf(self, leaf: Node, j: int, tokens, pages):
        assert not leaf.children and j == len(leaf.pages) - 1, "only a leaf's last page may be partial"
        self.pool.incref(pages)
        if leaf.pages[j] is not None:
            self.pool.decref([leaf.pages[j]])
        if leaf.host[j] is not None:
            self.tier.decref([leaf.host[j]])
        leaf.tokens = leaf.tokens[:j * self.P] + list(tokens)
        leaf.pages = leaf.pages[:j] + list(pages)
        leaf.host = leaf.host[:j] + [None] * len(pages)
        self._write_through(leaf, j)

    def _split(self, child: Node, j: int) -> Node:
        """Cut `child` before its page j; the new upper node is returned."""
        upper = Node(child.tokens[:j * self.P], child.pages[:j], child.host[:j], child.parent)
        upper.last_access = child.last_access
        child.parent.replace_child(child, upper)
        child.tokens, child.pages, child.host = child.tokens[j * self.P:], child.pages[j:], child.host[j:]
        child.parent = upper
        upper.add_child(child)
        return upper

    # -- the host tier -------------------------------------------------------------------------------
    def _write_through(self, node: Node, start: int) -> None:
        if self.tier is not None and self.tier.policy == "write_through":
            self._backup([(node, j) for j in range(start, len(node.pages))])

    def _backup(self, items: list[tuple[Node, int]]) -> int:
        """Give the full pages `items` host copies, as many as the host tier has room for (evicting its least
        recently used pages first); returns how many."""
        tier = self.tier
        short = len(items) - tier.num_free
        if short > 0:
            self.evict_host(eviction_size(short, tier))
        items = items[:tier.num_free]
        if items:
            host = sorted(tier.alloc(len(items)))  # the tree's references; in order, for longer runs to copy
            for (node, j), h in zip(items, host, strict=True):
                node.host[j] = h
            tier.backup([node.pages[j] for node, j in items], host)
        return len(items)

    def evict_host(self, num_pages: int) -> int:
        """Free up to `num_pages` host pages, least recently used first, never one a copy is using. Only the
        deepest host copies of a path go: a page also on the device just loses its copy, a host-only page is
        cut from the tree."""
        refcount, freed = self.tier.refcount, 0
        for node in self._lru():
            if freed >= num_pages:
                break
            if not node.pages or any(self._holds_host(c) for c in node.children):
                continue
            for j in reversed(range(len(node.pages))):
                h = node.host[j]
                if freed >= num_pages or (h is not None and refcount[h] != 1):
                    break
                if h is None:
                    continue
                if node.pages[j] is not None:
                    node.host[j] = None
                    self.tier.decref([h])
                else:
                    self._cut(node, j)
                freed += 1
        return freed

    # -- eviction and flush --------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` device pages held only by the tree, least recently used first and only the
        deepest device pages of a path (so the pages on the device always form a prefix of each path). A page
        with a host copy just leaves the device; under write_back a page without one is backed up (its backup
        reads it at once, in the compute stream's order) and leaves too; any other page is cut from the tree,
        with the host-only pages below it. Returns how many pages were freed."""
        refcount, freed, backlog = self.pool.refcount, 0, []
        if self.tier is not None:
            self.tier.flush()  # (queued backups hold their pages)
        write_back = self.tier is not None and self.tier.policy == "write_back"
        if write_back and num_pages > self.tier.num_free:
            self.evict_host(num_pages - self.tier.num_free)  # room for the backups
        for node in self._lru(on_device=True):
            if freed >= num_pages:
                break
            if not node.pages or node.pages[0] is None or any(c.pages[0] is not None for c in node.children):
                continue
            taken = []  # (j, device page) of the node's pages to back up, deepest first
            for j in reversed(range(len(node.pages))):
                d = node.pages[j]
                if freed >= num_pages or (d is not None and refcount[d] != 1):
                    break
                if d is None:
                    continue
                if node.host[j] is None and write_back and self.tier.num_free > len(taken):
                    taken.append((j, d))  # the tree's reference, until the copy reads it
                    node.pages[j] = None
                elif node.host[j] is not None:
                    node.pages[j] = None
                    self.pool.decref([d])
                else:
                    self._take_host_pages(node, taken, backlog)
                    self._flush_backups(backlog)  # what is cut below may be waiting in it
                    self._cut(node, j)
                freed += 1
            self._take_host_pages(node, taken, backlog)
        self._flush_backups(backlog)
        return freed

    def _take_host_pages(self, node: Node, taken: list[tuple[int, int]], backlog: list[tuple[int, int]]) -> None:
        """Give the node's pages `taken` host pages, ascending with their position (a run of host pages, as far as
        the tier's free pages allow, is one copy for the backup and for a later load of the path)."""
        if taken:
            for (j, d), h in zip(reversed(taken), sorted(self.tier.alloc(len(taken))), strict=True):
                node.host[j] = h
                backlog.append((d, h))
            taken.clear()

    def _flush_backups(self, backlog: list[tuple[int, int]]) -> None:
        """Issue one copy for the (device page, host page) pairs eviction collected; it reads the device pages
        at once, so they are free when eviction returns."""
        if backlog:
            device, host = map(list, zip(*backlog, strict=True))
            self.tier.backup(device, host)
            self.tier.flush()
            self.pool.decref(device)
            backlog.clear()

    def _lru(self, on_device: bool = False) -> Iterator[Node]:
        """Every node (`on_device`: every node with a page on the device), least recently used first; children
        before their parent on ties. Lazy: eviction usually stops after a few nodes, so the order is a heap popped
        on demand rather than a sort."""
        heap = [(node.last_access, i, node) for i, node in enumerate(self._nodes(on_device))]
        heapq.heapify(heap)
        while heap:
            yield heapq.heappop(heap)[2]

    def _holds_host(self, node: Node) -> bool:
        return any(h is not None for h in node.host) or any(self._holds_host(c) for c in node.children)

    def _cut(self, node: Node, j: int) -> None:
        """Drop page j of `node` and everything after it: its later pages and its children (host-only pages
        only, by the callers' rules). A node left empty leaves the tree."""
        for child in node.children:
            self._drop(child)
        node.clear_children()
        for d, h in zip(node.pages[j:], node.host[j:], strict=True):
            if d is not None:
                self.pool.decref([d])
            if h is not None:
                self.tier.decref([h])
        node.pages, node.host, node.tokens = node.pages[:j], node.host[:j], node.tokens[:j * self.P]
        if not node.pages:
            node.parent.remove_child(node)

    def _drop(self, node: Node) -> None:
        for child in node.children:
            self._drop(child)
        self.pool.decref([d for d in node.pages if d is not None])
        if self.tier is not None:
            self.tier.decref([h for h in node.host if h is not None])
        node.pages, node.host = [], []
        node.clear_children()

    def reset(self) -> None:
        """Forget everything (after a weight update, its KV is stale). Pages still referenced by running
        requests or copies stay alive with them; the rest return to their pools."""
        for node in self._nodes():
            self.pool.decref([p for p in node.pages if p is not None])
            if self.tier is not None:
                self.tier.decref([h for h in node.host if h is not None])
        self.root = Node([], [], [], None)

    def _nodes(self, on_device: bool = False) -> list[Node]:
        """Every node but the root, children before their parent (the reverse of a pre-order walk that takes
        children in their list order). `on_device`: only those with a page on the device; the walk skips the
        subtrees wholly on the host (device pages are a prefix of each path: a node whose first page is on the host
        only has none below it), which under a host tier are most of the tree."""
        out, stack = [], self._kids(self.root, on_device)
        while stack:  # (one list operation a node: eviction walks the tree's device part every time it runs)
            node = stack.pop()
            out.append(node)
            if node.children:
                stack += self._kids(node, on_device)
        out.reverse()
        return out

    @staticmethod
    def _kids(node: Node, on_device: bool) -> list[Node]:
        """The node's children (`on_device`: those with a device page), last first: a stack pops the first."""
        if on_device:
            return [c for c in reversed(node.children) if c.pages[0] is not None]
        return node.children[::-1]

    @property
    def num_pages(self) -> int:
        return sum(p is not None for n in self._nodes() for p in n.pages)

    @property
    def num_host_pages(self) -> int:
        return sum(h is not None for n in self._nodes() for h in n.host)

    def check_invariants(self) -> None:
        """For tests: the tree's shape rules and its references."""
        P, seen, seen_host = self.P, set(), set()
        for node in self._nodes():
            assert node.pages and len(node.pages) == len(node.host), "empty or ragged node"
            assert node.parent is not None and node in node.parent.children
            assert node.key == node.tokens[0] and node in node.parent.by_first[node.key], "child index out of date"
            assert sum(map(len, node.by_first.values())) == len(node.children), "child index out of date"
            if node.children:
                assert len(node.tokens) == len(node.pages) * P, "internal node ends inside a page"
            else:
                assert (len(node.pages) - 1) * P < len(node.tokens) <= len(node.pages) * P
            above = node.parent.pages[-1] if node.parent is not self.root else 0
            for p, h in zip(node.pages, node.host, strict=True):
                assert p is not None or h is not None, "a page on neither tier"
                assert p is None or above is not None, "a device page below a host-only one"
                above = p
                if p is not None:
                    assert self.pool.refcount[p] >= 1, f"tree names free page {p}"
                    assert p not in seen, f"page {p} named twice"
                    seen.add(p)
                if h is not None:
                    assert self.tier.refcount[h] >= 1, f"tree names free host page {h}"
                    assert h not in seen_host, f"host page {h} named twice"
                    seen_host.add(h)
