"""The decode server's pass of a KV transfer by reference (`kv_index_sums.page_sums_by_index` with a destination and
the source pool's records), replayed as a CUDA graph: one launch on the host's way instead of four, no Triton
launcher and no allocation (`EngineConfig.kv_pass_graphs`).

`PassGraphs` holds, for one source pool (mapped) and one destination pool, a graph per page-count bucket (a power of
two, at least `MIN_BUCKET`), captured on its first use on a stream of its own. A graph's page index is a page-locked
buffer of its own that the kernels read in place; the pages past a transfer's are padded with no rows, of which the
kernels read and write nothing and whose sums are 0. The sums are copied into a page-locked buffer of the graph's in the
same graph, made `canonical` on the way. The pass is the eager one's, bit for bit (tests). A graph's buffers are its
own: callers serialise its use and each run waits for its sums before returning (as `EngineCore.write_reserved` does,
holding its gate from the pass to the sums read). CUDA only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.engine.kv_index_sums import canonical, kernel_pass
from tandem.engine.kv_transfer import TransferClock

__all__ = ["MIN_BUCKET", "PassGraphs", "bucket_of", "padded_index"]

MIN_BUCKET = 16  # pages: smaller transfers share its graph


def bucket_of(num: int) -> int:
    """The page-count bucket of a transfer of `num` pages."""
    return max(MIN_BUCKET, 1 << max(num - 1, 0).bit_length())


def padded_index(index: np.ndarray, src_pages, dst_pages, start: int, end: int, page_size: int) -> int:
    """Write a transfer's page index into `index` [3, bucket] (int32: source pages, destination pages, rows each):
    its pages first, every other page of no rows (page 0: read and written by nobody). Returns its page count."""
    num, n = len(src_pages), end - start
    if num != -(-n // page_size) or len(dst_pages) != num or num > index.shape[1]:
        raise ValueError(f"kv transfer: {num} pages (and {len(dst_pages)} to write) do not hold positions "
                         f"[{start}, {end}) in pages of {page_size}, or are more than {index.shape[1]}")
    index[:2, num:] = 0
    index[0, :num], index[1, :num] = src_pages, dst_pages
    index[2] = 0
    index[2, :num] = page_size
    if num:
        index[2, num - 1] = n - (num - 1) * page_size
    return num


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    index: np.ndarray  # [3, bucket] int32, a view of the page-locked buffer the kernels read
    host: torch.Tensor  # [2, bucket, 2] int64, page-locked: the sums the graph copies out
    done: torch.cuda.Event  # recorded behind each replay


class PassGraphs:
    """The fused pass from `src_k`, `src_v` (with their pool's checksum `records`) into `dst_k`, `dst_v` (pool
    tensors [L, S, K, D] on one GPU, `kv_copy.supports` them), pages of `page_size`, as CUDA graphs (see the
    module docstring). `run` is the pass."""

    def __init__(self, src_k: torch.Tensor, src_v: torch.Tensor, records: torch.Tensor, dst_k: torch.Tensor,
                 dst_v: torch.Tensor, page_size: int):
        self.src, self.dst, self.records, self.page_size = (src_k, src_v), (dst_k, dst_v), records, page_size
        self.device = src_k.device
        self._graphs: dict[int, _Graph] = {}
        self._stream: torch.cuda.Stream | None = None  # (captures only: nobody else queues work there)

    def run(self, src_pages, dst_pages, start: int, end: int, clock: TransferClock | None = None) -> np.ndarray:
        """Write positions [start, end) (`start` page-aligned) held in `src_pages` of the source into `dst_pages`
        of the destination, on the current stream, and return the sums [2, pages, 2] (`canonical`, int64 numpy):
        of what was read, and from the records; the host waits for them. Marks `clock` as `page_sums_by_index`
        does, "written" (a device mark) behind the replay and "synced" as the wait returns."""
        num = len(src_pages)
        g = self._graphs.get(bucket_of(num)) or self._capture(bucket_of(num))
        g.done.synchronize()  # (an earlier run's replay, if one raised before its wait, still reads the index)
        padded_index(g.index, src_pages, dst_pages, start, end, self.page_size)
        if clock is not None:
            clock.mark("staged", device=False)
            clock.mark("launch")
        g.graph.replay()
        g.done.record(torch.cuda.current_stream(self.device))
        if clock is not None:
            clock.mark("launched", device=False)
            clock.mark("written")
        g.done.synchronize()
        if clock is not None:
            clock.mark("synced", device=False)
        return g.host[:, :num].numpy().copy()  # (the buffer is the next run's)

    def _capture(self, bucket: int) -> _Graph:
        """The graph of `bucket` pages: the pass run once eagerly with every page of no rows (nothing read or
        written; it compiles what is not yet), then captured on this object's stream."""
        layers = self.src[0].shape[0]
        index = torch.zeros((3, bucket), dtype=torch.int32, pin_memory=True)
        parts = torch.empty((bucket, 2, layers, 2), dtype=torch.int64, device=self.device)
        sums = torch.empty((2, bucket, 2), dtype=torch.int64, device=self.device)
        host = torch.zeros((2, bucket, 2), dtype=torch.int64, pin_memory=True)

        def body() -> None:
            kernel_pass(self.src, self.dst, self.records, self.page_size, index, parts, sums)
            host.copy_(canonical(sums), non_blocking=True)

        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            body()
            self._stream.synchronize()
            graph.capture_begin(capture_error_mode="thread_local")  # (the engine's thread runs steps meanwhile)
            try:
                body()
            finally:
                graph.capture_end()
        g = self._graphs[bucket] = _Graph(graph, index.numpy(), host, torch.cuda.Event())
        g.done.record(self._stream)
        return g
