"""KV pages copied between two paged pools and checksummed in the same pass (prefill/decode disaggregation).

`copy_page_sums` reads whole pages of one pool's keys or values (`[L, S, K, D]`, slot-major: slot
`page * page_size + offset`), optionally writes each into a page of another pool, and returns the checksum parts of
what it read, per (page, layer): the definition is `tandem.engine.kv_transfer.page_sums`'s (each (layer, position)
a row of M int32 words; row part: each row's words summed modulo 2**32, sign-extended, times an odd row weight,
summed modulo 2**64; column part: each column's words summed over the page's positions, times an odd column weight,
summed modulo 2**32). The caller passes the weights and sums the parts over layers (and keys and values): one read of
every byte, one write where it copies, no gather buffer. Integer arithmetic with wrap-around, so the values are the
torch definition's bit for bit (tests/test_disagg_kv_copy.py compares them, under the Triton interpreter on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.kernels.fused import varying

__all__ = ["COPY_TILE", "SUMS_TILE", "Tile", "copy_page_sums", "supports"]


@dataclass(frozen=True)
class Tile:
    """How a program of the kernel walks its (page, layer): `words` 32-bit words held at once (the page's rows x a
    chunk of the row: the chunk is `words` / rows rounded to a power of 2, at least 16 and at most the row) and
    `num_warps` warps; `stream`: its loads marked evict-first and its stores streaming (each byte is touched once);
    `defer`: the chunks summed word by word into two accumulators the size of a chunk (the words, and the words
    times their column weights, both modulo 2**32), reduced across the program once at the end, instead of two
    reductions across it per chunk (more registers, no barrier between one chunk's loads and the next's).
    Any tile gives the same sums and writes (tests/test_disagg_kv_copy.py); only the speed differs
    (`benchmarks/kv_copy_bench.py --sweep` times a grid of them)."""

    words: int = 4096
    num_warps: int = 4
    stream: bool = False
    defer: bool = False

    def __post_init__(self):
        if self.words < 16 or self.words & (self.words - 1) or self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"Tile: words must be a power of 2 >= 16 and num_warps one of 1-32 (powers of 2), "
                             f"got {self.words}, {self.num_warps}")


# chosen by `kv_copy_bench.py --sweep` on an H200 at qwen3-0.6b's layout (BENCHMARKS.md has the sweep)
COPY_TILE = Tile(16384, 2)  # the fused pass's (a decode server's import)
SUMS_TILE = Tile(16384, 4)  # the checksum pass alone's (the tests' reference; the benchmark's row)


@triton.jit(**varying("src_pages_ptr", "dst_pages_ptr", "rows_ptr", "out_ptr"))  # (rows of one staged index)
def _copy_page_sums_kernel(src_ptr, dst_ptr, src_pages_ptr, dst_pages_ptr, rows_ptr, row_w_ptr, col_w_ptr, out_ptr,
                           src_slots, dst_slots, out_stride, words: tl.constexpr, page_size: tl.constexpr,
                           WRITE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
                           EVICT: tl.constexpr, STORE_CACHE: tl.constexpr, DEFER: tl.constexpr):
    """One program: page `i` of the transfer, layer `layer`. Reads its valid rows (int32 words), writes them into
    the destination page (WRITE), and stores (row part int64, column part int64 with the low 32 bits meaningful)
    at out[i, layer] (`out_stride` int64 apart from one page to the next, a layer's two parts after another's)."""
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)  # (offsets in int64: a pool may hold more than 2**31 words)
    n_rows = tl.load(rows_ptr + i)
    offs_p = tl.arange(0, BLOCK_P)
    row_ok = offs_p < n_rows
    src_page = tl.load(src_pages_ptr + i).to(tl.int64)
    src_row = (layer * src_slots + src_page * page_size + offs_p) * words
    if WRITE:
        dst_page = tl.load(dst_pages_ptr + i).to(tl.int64)
        dst_row = (layer * dst_slots + dst_page * page_size + offs_p) * words
    row_acc = tl.zeros([BLOCK_P], dtype=tl.int32)
    col_acc = tl.zeros([BLOCK_M], dtype=tl.int64)
    if DEFER:
        words_acc = tl.zeros([BLOCK_P, BLOCK_M], dtype=tl.int32)
        weighted_acc = tl.zeros([BLOCK_P, BLOCK_M], dtype=tl.int32)
    for m0 in range(0, words, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < words
        mask = row_ok[:, None] & m_ok[None, :]
        tile = tl.load(src_ptr + src_row[:, None] + offs_m[None, :], mask=mask, other=0, eviction_policy=EVICT)
        if WRITE:
            tl.store(dst_ptr + dst_row[:, None] + offs_m[None, :], tile, mask=mask, cache_modifier=STORE_CACHE)
        col_w = tl.load(col_w_ptr + layer * words + offs_m, mask=m_ok, other=0)
        if DEFER:  # (int32 arithmetic wraps: the column part is modulo 2**32, the row sums too)
            words_acc += tile
            weighted_acc += tile * col_w.to(tl.int32)[None, :]
        else:
            row_acc += tl.sum(tile, axis=1).to(tl.int32)
            col_acc += tl.sum(tile, axis=0).to(tl.int32).to(tl.int64) * col_w
    if DEFER:
        row_acc = tl.sum(words_acc, axis=1).to(tl.int32)
        col_part = tl.sum(tl.sum(weighted_acc, axis=1).to(tl.int32), axis=0).to(tl.int32).to(tl.int64)
    else:
        col_part = tl.sum(col_acc, axis=0)
    row_w = tl.load(row_w_ptr + layer * page_size + offs_p, mask=row_ok, other=0)
    row_part = tl.sum(row_acc.to(tl.int64) * row_w, axis=0)
    out = out_ptr + i * out_stride + layer * 2
    tl.store(out, row_part)
    tl.store(out + 1, col_part)


def supports(cache: torch.Tensor) -> bool:
    """Whether `copy_page_sums` takes this pool tensor: contiguous [L, S, K, D] whose rows (a position's K x D)
    and last dimension divide into 4-byte words."""
    return (cache.dim() == 4 and cache.is_contiguous()
            and (cache.shape[3] * cache.element_size()) % 4 == 0)


def copy_page_sums(src: torch.Tensor, src_pages: torch.Tensor, rows: torch.Tensor, page_size: int,
                   row_w: torch.Tensor, col_w: torch.Tensor, dst: torch.Tensor | None = None,
                   dst_pages: torch.Tensor | None = None, out: torch.Tensor | None = None,
                   tile: Tile | None = None) -> torch.Tensor:
    """Checksum parts [pages, L, 2] (int64: row part, column part) of page `src_pages[i]`'s first `rows[i]`
    positions of pool tensor `src` [L, S, K, D], for every layer; with `dst`, those positions also written into
    page `dst_pages[i]` of pool tensor `dst` (same L, K, D, dtype). `src_pages`, `dst_pages`, `rows`: int32 on
    `src`'s device; `row_w` [L, page_size] and `col_w` [L, M] int64 weights (M: 32-bit words a position of a layer).
    Asynchronous (queued on the current stream). Both pools must pass `supports`. `out`: where to put the parts
    (a [pages, L, 2] int64 view whose last two dimensions are contiguous), else a new tensor. `tile`: how each
    program walks its page (speed only; by default `COPY_TILE` with `dst`, else `SUMS_TILE`)."""
    for name, t in (("src", src), ("dst", dst)):
        if t is not None and not supports(t):
            raise ValueError(f"copy_page_sums: {name} {tuple(t.shape)} {t.dtype} is not a contiguous pool of words")
    layers = src.shape[0]
    words_src = src.view(torch.int32)
    num, words = src_pages.numel(), words_src.shape[2] * words_src.shape[3]
    if dst is not None and (dst.shape[0] != layers or dst.shape[2:] != src.shape[2:] or dst.dtype != src.dtype):
        raise ValueError(f"copy_page_sums: dst {tuple(dst.shape)} {dst.dtype} is not src's layout "
                         f"{tuple(src.shape)} {src.dtype}")
    if out is None:
        out = torch.empty((num, layers, 2), dtype=torch.int64, device=src.device)
    if out.shape != (num, layers, 2) or out.dtype != torch.int64 or out.stride()[1:] != (2, 1):
        raise ValueError(f"copy_page_sums: out {tuple(out.shape)} {out.dtype} {out.stride()} is no [pages, L, 2] "
                         "int64 of contiguous rows")
    if num == 0:
        return out
    tile = tile or (COPY_TILE if dst is not None else SUMS_TILE)
    block_p = triton.next_power_of_2(page_size)
    block_m = max(16, min(triton.next_power_of_2(words), tile.words // block_p))
    words_dst = dst.view(torch.int32) if dst is not None else words_src
    _copy_page_sums_kernel[(num, layers)](
        words_src, words_dst, src_pages, dst_pages if dst_pages is not None else src_pages, rows, row_w, col_w, out,
        src.shape[1], words_dst.shape[1], out.stride(0), words, page_size,
        WRITE=dst is not None, BLOCK_P=block_p, BLOCK_M=block_m,
        EVICT="evict_first" if tile.stream else "", STORE_CACHE=".cs" if tile.stream else "", DEFER=tile.defer,
        num_warps=tile.num_warps)
    return out
