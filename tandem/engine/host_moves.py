"""The host tier's copies by kernel launches (`tandem.kernels.page_move.move_pages`; zero-copy: the kernel loads
and stores page-locked host memory over the bus), their page indices in a kept pinned ring the kernel reads in
place: no index upload, no copy per run of host pages. `engine.host_cache_copy: direct`: a backup moves pool pages
straight into host pages, a load host pages (or a prefetch's device staging) straight into pool pages, a prefetch
host pages into its staging, one launch each; `staged_kernels`: the staged halves (gather, crossing, scatter), one
launch each.

Where each runs (`tandem.engine.step_order`) is the `HostTier`'s business; this holds the stores and the ring,
compiles the kernel's variants at start-up, and seals the ring's regions behind the events the tier records after
its launches.
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
        if self.cuda:
            self._compile(pool.num_pages, kv.shape[1:], None if routing is None else routing.shape[1:])

    def _compile(self, scratch: int, page: tuple, routing_page: tuple | None) -> None:
        """Launch every pair of stores the tier moves between once, now (the pool's scratch page, host page 0 and a
        staging page: nothing anyone holds yet), so that no copy compiles a kernel mid-run."""
        staging = self.staging((torch.empty((1, *page), dtype=self.host.k.dtype, device=self.pool.k.device),
                                None if routing_page is None else torch.empty(
                                    (1, *routing_page), dtype=self.host.routing.dtype, device=self.pool.k.device)))
        for src, dst, a, b in ((self.pool, self.host, scratch, 0), (self.host, self.pool, 0, scratch),
                               (self.pool, staging, scratch, 0), (staging, self.host, 0, 0),
                               (self.host, staging, 0, 0), (staging, self.pool, 0, scratch)):
            self.move(src, dst, [a], [b])
        self.done()
        torch.cuda.current_stream().synchronize()  # (the staging page goes)

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
