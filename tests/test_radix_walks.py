"""The radix cache's walks, which eviction's order rests on: `_nodes` lists every node (or every node with a
device page) children before their parent, later siblings first, and eviction's least-recently-used order breaks
ties by that position. A faster walk must list exactly what the plain recursive one does, on trees with host-only
subtrees (a host tier) as well."""

import random

import torch

from tandem.config import PRESETS
from tandem.engine.host_tier import HostTier
from tandem.engine.kv_pool import KVPool
from tandem.engine.radix_cache import RadixCache, lcp

P = 4


def reference(node, on_device: bool) -> list:
    """Every node below `node`, each after its subtree, its children taken last first (recursively)."""
    out = []
    for child in reversed(node.children):
        if not on_device or child.pages[0] is not None:
            out += reference(child, on_device) + [child]
    return out


def random_tree(seed: int) -> RadixCache:
    """A tree grown by random inserts and evictions of both tiers over three symbols (shared prefixes, splits inside
    and at page boundaries), with a host tier, so that some subtrees are on the host only."""
    rng = random.Random(seed)
    pool = KVPool(PRESETS["tiny"], 24, P, torch.float32, "cpu")
    tier = HostTier(pool, 40, "write_through")
    cache = RadixCache(pool, tier)
    for _ in range(30):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
        need = -(-len(tokens) // P)
        if pool.num_free < need:
            cache.evict(need - pool.num_free)
        pages = pool.alloc(need)
        if pages is None:
            continue
        cache.insert(tokens, pages)
        pool.decref(pages)
        tier.reap()
        if rng.random() < 0.3:
            cache.evict(rng.randrange(1, 8))
        if rng.random() < 0.2:
            cache.evict_host(rng.randrange(1, 8))
    cache.check_invariants()
    return cache


def test_node_walks_list_children_before_parents_later_siblings_first():
    host_only = 0
    for seed in range(40):
        cache = random_tree(seed)
        assert cache._nodes() == reference(cache.root, False)
        assert cache._nodes(on_device=True) == reference(cache.root, True)
        host_only += len(cache._nodes()) - len(cache._nodes(on_device=True))
    assert host_only > 0, "no tree had a host-only subtree: the on_device walk went untested"


def test_lcp_is_the_length_of_the_common_prefix():
    rng = random.Random(0)
    for _ in range(2000):
        a = [rng.randrange(2) for _ in range(rng.randrange(0, 12))]
        b = a[:rng.randrange(0, len(a) + 1)] + [rng.randrange(2) for _ in range(rng.randrange(0, 12))]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert lcp(a, b) == lcp(b, a) == n
