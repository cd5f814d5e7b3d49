"""The host tier's copies as one kernel launch each (`engine.host_cache_copy: direct`): a backup moves pool pages
straight into pinned host pages, a load host pages (or a prefetch's device staging) straight into pool pages, a
prefetch host pages into its staging, each by `tandem.kernels.page_move.move_pages` (zero-copy: the kernel loads
and stores page-locked host memory over the bus), its page indices in a kept pinned ring the kernel reads in
place. No staging for backups and loads, no index upload, no copy per run of host pages.

Where each runs (`tandem.engine.step_order`: tier_backup_direct, tier_load_direct, tier_take_prefetch,
tier_prefetch) is the `HostTier`'s business; this holds the stores and the ring, and seals the ring's regions
behind the event the tier records after its launches.
"""

from __future__ import annotations

import torch

from tandem.engine.kv_pool import KVPool


class PageMoves:
    def __init__(self, pool: KVPool, kv: torch.Tensor, routing: torch.Tensor | None):
        """`kv` [host pages, 2, L, P, K, D] and `routing` [host pages, P, layers, k] (or None): the tier's host
        pages (pinned where the pool is on CUDA)."""
        from tandem.kernels.page_move import IndexRing, paged_store, pool_store  # (Triton: only when used)

        self.cuda = pool.k_cache.is_cuda
        self.pool = pool_store(pool.k_cache, pool.v_cache, pool.routing, pool.page_size)
        self.host = paged_store(kv, routing)
        # (a move puts twice its pages, at most a pool's: the ring holds several of the largest)
        self.ring = IndexRing(max(1 << 16, 8 * (pool.num_pages + 1)), pinned=self.cuda)

    @staticmethod
    def staging(staged: tuple):
        """The store of a staging tensor pair (KV [n, 2, L, P, K, D], routing or None): its rows are pages."""
        from tandem.kernels.page_move import paged_store

        return paged_store(*staged)

    def move(self, src, dst, src_pages: list[int], dst_pages: list[int]) -> None:
        """Pages `src_pages` of store `src` into pages `dst_pages` of `dst`: one launch on the current stream.
        Seal (`done`) before the ring comes round."""
        self.launch(src, dst, len(src_pages), self.ring.put(src_pages + dst_pages))

    def launch(self, src, dst, num_pages: int, at: int) -> None:
        """`move` of the pages whose indices are at `at` of the ring (`ring.put`: sources, then destinations)."""
        from tandem.kernels.page_move import move_pages

        move_pages(src, dst, self.ring.buffer, num_pages, at)

    def done(self) -> torch.cuda.Event | None:
        """An event after the moves issued so far on the current stream (CUDA), which seals their ring regions."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        self.ring.seal(event)
        return event
