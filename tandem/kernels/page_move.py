"""Whole KV pages moved between two page stores by page index, keys, values and routing in one kernel launch.

A page store (`PageStore`) is where pages of KV live, whatever the layout: the device pool (`pool_store`: keys and
values [L, S, K, D], slot `page * page_size + offset`) or a page-major tensor [pages, 2, L, P, K, D] (`paged_store`:
the host tier's pinned pages, or a device staging tensor). Either way one page of one layer of keys (or values) is
`page_size * K * D` contiguous elements, and one page of routing (`[P, layers, k]` expert ids) is contiguous too;
the stores differ only in the strides between those chunks, which the kernel takes as compile-time constants (one
compiled variant per pair of layouts, and provably aligned offsets, so its loads and stores are vectorised).

Zero-copy through unified virtual addressing: on a CUDA machine a page-locked (pinned) host tensor is mapped into
the device's address space at its own address, so a kernel loads and stores it directly over the bus; the index
of pages may live in pinned memory too (the kernel reads it there: no upload). Triton's launcher takes a pinned CPU
tensor as a pointer argument as it is: it resolves every pointer through `cuPointerGetAttribute(...DEVICE_POINTER)`,
which gives a pinned buffer's device address and refuses pageable memory ("cannot be accessed from Triton"); so
`move_pages` checks first that a CPU tensor it is given beside CUDA ones is pinned, and says so if not. On a CPU
(no CUDA tensor) the kernel runs under Triton's interpreter, for the tests; the engine's CPU path is torch's own
indexed copies (`HostTier`).
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.kernels.fused import varying

__all__ = ["PROGRAMS", "IndexRing", "PageStore", "move_pages", "paged_store", "pool_store"]

# Programs of one launch: few enough that a move on a side stream leaves the compute stream's kernels most of the
# device (each program streams its pages; the bus, not the programs, bounds a move to or from host memory).
PROGRAMS = 32


@dataclass(frozen=True)
class PageStore:
    """Pages of KV (and routing) by page index: page p of layer l of keys starts at `k[p * page_stride + l *
    layer_stride]` (values likewise in `v`), `chunk` contiguous elements; page p of routing at
    `routing[p * routing_stride]`, `routing_chunk` contiguous elements. `k`, `v`, `routing`: flat views of the
    storage (a store's tensors are never copied: the kernel writes into them), all on one side (device or host,
    routing too)."""

    k: torch.Tensor
    v: torch.Tensor
    routing: torch.Tensor | None
    layers: int
    chunk: int
    page_stride: int
    layer_stride: int
    routing_chunk: int = 0
    routing_stride: int = 0

    @functools.cached_property
    def mappable(self) -> bool:
        """Whether a CUDA kernel can reach it: on the device, or page-locked host memory."""
        return self.k.is_cuda or self.k.is_pinned()


def pool_store(k_cache: torch.Tensor, v_cache: torch.Tensor, routing: torch.Tensor | None,
               page_size: int) -> PageStore:
    """The device pool's store: `k_cache`, `v_cache` contiguous [L, S, K, D]; `routing` contiguous [S, layers, k]
    or None."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape):
        raise ValueError(f"pool_store: keys {tuple(k_cache.shape)} and values {tuple(v_cache.shape)} must be "
                         "contiguous [L, S, K, D] of one shape")
    L, S, K, D = k_cache.shape
    r_chunk = 0 if routing is None else page_size * routing[0].numel()
    if routing is not None and not routing.is_contiguous():
        raise ValueError("pool_store: routing must be contiguous [S, layers, k]")
    return PageStore(k_cache.view(-1), v_cache.view(-1), None if routing is None else routing.view(-1), L,
                     page_size * K * D, page_size * K * D, S * K * D, r_chunk, r_chunk)


def paged_store(kv: torch.Tensor, routing: torch.Tensor | None = None) -> PageStore:
    """A page-major store: `kv` contiguous [pages, 2, L, P, K, D] (keys at [:, 0], values at [:, 1]); `routing`
    contiguous [pages, P, layers, k] or None."""
    if kv.dim() != 6 or kv.shape[1] != 2 or not kv.is_contiguous():
        raise ValueError(f"paged_store: kv {tuple(kv.shape)} must be contiguous [pages, 2, L, P, K, D]")
    if routing is not None and not routing.is_contiguous():
        raise ValueError("paged_store: routing must be contiguous [pages, P, layers, k]")
    _, _, L, P, K, D = kv.shape
    chunk = P * K * D
    flat = kv.view(-1)
    r_chunk = 0 if routing is None else routing[0].numel()
    return PageStore(flat, flat[L * chunk:], None if routing is None else routing.view(-1), L, chunk, 2 * L * chunk,
                     chunk, r_chunk, r_chunk)


@triton.jit(**varying("index_ptr", "src_at", "dst_at", "num_pages"))
def _move_pages_kernel(src_k, src_v, src_r, dst_k, dst_v, dst_r, index_ptr, src_at, dst_at, num_pages,
                       LAYERS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                       SRC_PAGE: tl.constexpr, SRC_LAYER: tl.constexpr, DST_PAGE: tl.constexpr,
                       DST_LAYER: tl.constexpr, R_CHUNK: tl.constexpr, R_BLOCK: tl.constexpr,
                       SRC_R_PAGE: tl.constexpr, DST_R_PAGE: tl.constexpr):
    """Program g moves items g, g + G, ... (G programs) of the `num_pages * LAYERS` (page i, layer l): keys and
    values of layer l of source page index[src_at + i] into destination page index[dst_at + i], and (layer 0,
    R_CHUNK > 0) the page's routing."""
    g = tl.program_id(0)
    for item in range(g, num_pages * LAYERS, tl.num_programs(0)):
        i = item // LAYERS
        layer = tl.cast(item % LAYERS, tl.int64)  # (offsets in int64: a pool may hold more than 2**31 elements)
        src_page = tl.load(index_ptr + src_at + i).to(tl.int64)
        dst_page = tl.load(index_ptr + dst_at + i).to(tl.int64)
        src = src_page * SRC_PAGE + layer * SRC_LAYER
        dst = dst_page * DST_PAGE + layer * DST_LAYER
        for c in range(0, CHUNK, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            mask = offs < CHUNK
            tl.store(dst_k + dst + offs, tl.load(src_k + src + offs, mask=mask), mask=mask)
            tl.store(dst_v + dst + offs, tl.load(src_v + src + offs, mask=mask), mask=mask)
        if R_CHUNK > 0:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if layer == 0:
                for c in range(0, R_CHUNK, R_BLOCK):
                    offs = c + tl.arange(0, R_BLOCK)
                    mask = offs < R_CHUNK
                    values = tl.load(src_r + src_page * SRC_R_PAGE + offs, mask=mask)
                    tl.store(dst_r + dst_page * DST_R_PAGE + offs, values, mask=mask)


def _pow2(n: int) -> int:
    """The least power of 2 >= n (>= 1). (`triton.next_power_of_2` costs microseconds a call, being jit-callable.)"""
    return 1 << max(0, n - 1).bit_length()


def _check_mapped(src: PageStore, dst: PageStore, index: torch.Tensor) -> None:
    """A launch with any CUDA tensor reaches its CPU tensors through their device mapping: they must be pinned."""
    if src.k.is_cuda or dst.k.is_cuda or index.is_cuda:
        for name, ok in (("source", src.mappable), ("destination", dst.mappable),
                         ("index", index.is_cuda or index.is_pinned())):
            if not ok:
                raise ValueError(f"move_pages: the {name} is in pageable host memory, which a CUDA kernel cannot "
                                 "reach: host memory a kernel reads or writes must be page-locked (pinned)")


def move_pages(src: PageStore, dst: PageStore, index: torch.Tensor, num_pages: int, src_at: int = 0,
               dst_at: int | None = None, programs: int = PROGRAMS) -> None:
    """Copy `num_pages` whole pages, keys, values and (if both stores keep it) routing: source page
    `index[src_at + i]` of `src` into destination page `index[dst_at + i]` of `dst` (`dst_at` default: right after
    the source pages). `index`: int32, on the device or pinned on the host (read there by the kernel); it and the
    stores must stay unchanged and alive until the launch has run. One launch, queued on the current stream
    (asynchronous on CUDA); bit-exact. The stores must agree in layers, chunk, dtype and routing."""
    if dst_at is None:
        dst_at = src_at + num_pages
    if (src.layers, src.chunk, src.k.dtype, src.routing_chunk) != (dst.layers, dst.chunk, dst.k.dtype,
                                                                   dst.routing_chunk):
        raise ValueError(f"move_pages: stores of different pages: {src.layers} layers of {src.chunk} {src.k.dtype} "
                         f"(routing {src.routing_chunk}) and {dst.layers} of {dst.chunk} {dst.k.dtype} "
                         f"(routing {dst.routing_chunk})")
    if index.dtype != torch.int32 or max(src_at, dst_at) + num_pages > index.numel():
        raise ValueError(f"move_pages: index {index.dtype} of {index.numel()} does not hold pages "
                         f"[{src_at}, {src_at + num_pages}) and [{dst_at}, {dst_at + num_pages}) as int32")
    routing = src.routing is not None and dst.routing is not None
    _check_mapped(src, dst, index)
    if num_pages == 0:
        return
    block = min(_pow2(src.chunk), 4096)
    r_block = min(_pow2(src.routing_chunk), 4096)
    grid = (max(1, min(programs, num_pages * src.layers)),)
    _move_pages_kernel[grid](
        src.k, src.v, src.routing if routing else src.k, dst.k, dst.v, dst.routing if routing else dst.k,
        index, src_at, dst_at, num_pages,
        LAYERS=src.layers, CHUNK=src.chunk, BLOCK=block, SRC_PAGE=src.page_stride, SRC_LAYER=src.layer_stride,
        DST_PAGE=dst.page_stride, DST_LAYER=dst.layer_stride, R_CHUNK=src.routing_chunk if routing else 0,
        R_BLOCK=r_block, SRC_R_PAGE=src.routing_stride, DST_R_PAGE=dst.routing_stride, num_warps=4)


class IndexRing:
    """Page indices for `move_pages` in one kept int32 buffer (pinned on CUDA: the kernel reads it over the bus,
    no upload op), written from the host through a numpy view, handed out round the ring. A region is written again
    only once the launches that read it have run: `seal(event)` marks the regions put since the last seal as read
    by the work before `event`; a put that would overwrite a region waits for its event (long past, as a rule). On
    a CPU (launches synchronous) no region needs sealing."""

    def __init__(self, capacity: int, pinned: bool, guarded: bool | None = None):
        """`guarded` (default: `pinned`): regions are sealed, and a put waits for the events of those it rewrites."""
        self.buffer = torch.zeros(capacity, dtype=torch.int32, pin_memory=pinned)
        self._np = self.buffer.numpy()
        self.guarded = pinned if guarded is None else guarded
        self._head = 0
        self._live: deque[list] = deque()  # [start, end, event or None (not sealed yet)], oldest first
        self.waits = 0  # puts that had to wait for a launch to run

    def put(self, values: list[int]) -> int:
        """Write `values` into the ring and return their offset in `buffer`."""
        n, capacity = len(values), self.buffer.numel()
        if n > capacity:
            raise ValueError(f"IndexRing: {n} indices do not fit in {capacity}")
        start = self._head
        if start + n > capacity:  # round to the start: the tail left unused is taken back too
            self._reclaim(start, capacity)
            start = 0
        self._reclaim(start, start + n)
        self._np[start:start + n] = values
        self._head = start + n
        if self.guarded and n:
            self._live.append([start, start + n, None])
        return start

    def _reclaim(self, start: int, end: int) -> None:
        """Wait for the launches reading [start, end) (the oldest regions: the live ones lie round the ring from
        the oldest to the head) and forget them."""
        while self._live and self._live[0][0] < end and start < self._live[0][1]:
            _, _, event = self._live.popleft()
            assert event is not None, "IndexRing: a region is rewritten before its launch was sealed"
            if not event.query():
                self.waits += 1
                event.synchronize()

    def seal(self, event) -> None:
        """The regions put since the last seal are read by work queued before `event`."""
        for region in reversed(self._live):
            if region[2] is not None:
                break
            region[2] = event
