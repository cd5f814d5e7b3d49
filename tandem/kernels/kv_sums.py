"""Each written KV position's part of its page's checksum, recorded as the forward writes it (a prefill server's
export then needs no checksum pass: `KVPool.page_sums`).

`record_slot_sums` takes one layer's keys and values as the forward left them in the pool and stores, per slot
written, that position's share of `tandem.engine.kv_transfer.page_sums` for this layer: the row part (its keys' and
values' row sums modulo 2**32, sign-extended, times their odd weights of (tensor, layer, offset in the page), summed
modulo 2**64) and the column part (its words times their odd weights of (tensor, layer, column), summed modulo
2**32). Both parts of `page_sums` are sums over a page's positions of these shares, so a page's checksum is the sum
of its slots' records over its positions and layers. A record is stored, not added: a position written again (a
recomputed token, a page reused) replaces its share, so the records are always those of the bytes last written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.fused import varying

__all__ = ["record_slot_sums", "supports"]


@triton.jit(**varying("slots_ptr"))
def _record_kernel(k_ptr, v_ptr, slots_ptr, out_ptr, row_k_ptr, row_v_ptr, col_k_ptr, col_v_ptr, out_stride,
                   words: tl.constexpr, page_size: tl.constexpr, BLOCK_M: tl.constexpr):
    """One program: the step's token `t`, whose keys and values (`words` int32 words each) are at `slots[t]`."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_M)
    ok = offs < words
    k = tl.load(k_ptr + slot * words + offs, mask=ok, other=0)
    v = tl.load(v_ptr + slot * words + offs, mask=ok, other=0)
    col_k = tl.load(col_k_ptr + offs, mask=ok, other=0).to(tl.int32)
    col_v = tl.load(col_v_ptr + offs, mask=ok, other=0).to(tl.int32)
    # (int32 arithmetic wraps: the row sums and the column part are modulo 2**32)
    col_part = tl.sum(k * col_k + v * col_v, axis=0).to(tl.int32).to(tl.int64)
    offset = slot % page_size
    row_part = (tl.sum(k, axis=0).to(tl.int32).to(tl.int64) * tl.load(row_k_ptr + offset)
                + tl.sum(v, axis=0).to(tl.int32).to(tl.int64) * tl.load(row_v_ptr + offset))
    tl.store(out_ptr + slot * out_stride, row_part)
    tl.store(out_ptr + slot * out_stride + 1, col_part)


def supports(cache: torch.Tensor) -> bool:
    """Whether the kernel takes this layer of a pool ([S, K, D], contiguous, a position's bytes in 4-byte words)."""
    return cache.is_contiguous() and (cache.shape[1] * cache.shape[2] * cache.element_size()) % 4 == 0


def record_slot_sums(k_SKD: torch.Tensor, v_SKD: torch.Tensor, slots_T: torch.Tensor, out_S2: torch.Tensor,
                     weights: tuple, page_size: int) -> None:
    """Store at `out_S2[slot]` (int64 [S, 2] rows, the last dimension contiguous: one layer of `KVPool.sums`) the
    row and column parts of the keys and values at each slot of `slots_T` (one layer of a pool, [S, K, D], which
    both pass `supports`). `weights`: this layer's (keys' row weights [page_size], keys' column weights [M], values'
    row weights, values' column weights), int64, from `kv_transfer.checksum_weights`. Asynchronous (queued on the
    current stream); a slot that appears twice gets either position's record."""
    row_k, col_k, row_v, col_v = weights
    if T := slots_T.numel():
        words = k_SKD[0].numel() * k_SKD.element_size() // 4
        _record_kernel[(T,)](k_SKD.view(torch.int32), v_SKD.view(torch.int32), slots_T, out_S2, row_k, row_v,
                             col_k, col_v, out_S2.stride(0), words, page_size,
                             BLOCK_M=triton.next_power_of_2(words), num_warps=4 if words >= 512 else 1)
