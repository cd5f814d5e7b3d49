"""Each written KV position's part of its page's checksum, recorded as the forward writes it (a prefill server's
export then needs no checksum pass: the decode server, which maps the records, takes `page_sums` of the exported
pages' records, `kv_index_sums.record_sums_by_index`, behind its own pass over them).

`record_slot_sums` takes the keys and values the forward left in the pool and stores, per slot written and per
layer, that position's share of `tandem.engine.kv_transfer.page_sums`: the row part (its keys' and
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

__all__ = ["page_sums", "record_slot_sums", "supports"]

RECORD_WORDS = 4096  # 32-bit words of keys (and as many of values) a program of the recording holds at once


@triton.jit(**varying("slots_ptr", "num_tokens"))
def _record_kernel(k_ptr, v_ptr, slots_ptr, out_ptr, row_k_ptr, row_v_ptr, col_k_ptr, col_v_ptr, num_tokens,
                   layer_words, words: tl.constexpr, page_size: tl.constexpr, layers: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr):
    """One program: layer `program_id(1)` of tokens [BLOCK_T * i, BLOCK_T * (i + 1)) of the step, whose keys and
    values (`words` int32 words each; a layer `layer_words` words apart) are at their `slots` (the layer's column
    weights loaded once for them all)."""
    layer = tl.program_id(1).to(tl.int64)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < num_tokens
    slot = tl.load(slots_ptr + offs_t, mask=t_ok, other=0).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < words
    ok = t_ok[:, None] & m_ok[None, :]
    at = layer * layer_words + slot[:, None] * words + offs_m[None, :]
    k = tl.load(k_ptr + at, mask=ok, other=0)
    v = tl.load(v_ptr + at, mask=ok, other=0)
    col_k = tl.load(col_k_ptr + layer * words + offs_m, mask=m_ok, other=0).to(tl.int32)
    col_v = tl.load(col_v_ptr + layer * words + offs_m, mask=m_ok, other=0).to(tl.int32)
    # (int32 arithmetic wraps: the row sums and the column part are modulo 2**32)
    col_part = tl.sum(k * col_k[None, :] + v * col_v[None, :], axis=1).to(tl.int32).to(tl.int64)
    offset = layer * page_size + slot % page_size
    row_part = (tl.sum(k, axis=1).to(tl.int32).to(tl.int64) * tl.load(row_k_ptr + offset, mask=t_ok, other=0)
                + tl.sum(v, axis=1).to(tl.int32).to(tl.int64) * tl.load(row_v_ptr + offset, mask=t_ok, other=0))
    out = out_ptr + (slot * layers + layer) * 2
    tl.store(out, row_part, mask=t_ok)
    tl.store(out + 1, col_part, mask=t_ok)


@triton.jit(**varying("pages_ptr", "rows_ptr", "out_ptr"))
def _page_sums_kernel(records_ptr, pages_ptr, rows_ptr, out_ptr, page_size: tl.constexpr, parts: tl.constexpr,
                      BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program: page `pages[i]`'s first `rows[i]` slots' records (`parts` int64 each: row and column parts,
    layer after layer), summed into out[i] (row part, column part)."""
    i = tl.program_id(0)
    page = tl.load(pages_ptr + i).to(tl.int64)
    offs_p = tl.arange(0, BLOCK_P)
    offs_r = tl.arange(0, BLOCK_R)
    ok = (offs_p < tl.load(rows_ptr + i))[:, None] & (offs_r < parts)[None, :]
    records = tl.load(records_ptr + (page * page_size + offs_p)[:, None] * parts + offs_r[None, :], mask=ok, other=0)
    by_part = tl.sum(records, axis=0)  # (int64, wrapping)
    tl.store(out_ptr + 2 * i, tl.sum(tl.where(offs_r % 2 == 0, by_part, 0), axis=0))
    tl.store(out_ptr + 2 * i + 1, tl.sum(tl.where(offs_r % 2 == 1, by_part, 0), axis=0))


def supports(cache: torch.Tensor) -> bool:
    """Whether the kernel takes this pool tensor ([L, S, K, D], contiguous, a position's bytes in 4-byte words)."""
    return cache.is_contiguous() and (cache.shape[2] * cache.shape[3] * cache.element_size()) % 4 == 0


def record_slot_sums(k_LSKD: torch.Tensor, v_LSKD: torch.Tensor, slots_T: torch.Tensor, out_SL2: torch.Tensor,
                     weights: tuple, page_size: int) -> None:
    """Store at `out_SL2[slot]` (`KVPool.sums` [S, L, 2] int64, contiguous) the row and column parts, every layer,
    of the keys and values at each slot of `slots_T` (of pool tensors [L, S, K, D], which both pass `supports`).
    `weights`: (keys' row weights [L, page_size], keys' column weights [L, M], values' row weights, values' column
    weights), int64, from `kv_transfer.checksum_weights`. One launch, asynchronous (queued on the current stream); a
    slot that appears twice gets either position's record."""
    row_k, col_k, row_v, col_v = weights
    if T := slots_T.numel():
        layers, slots = k_LSKD.shape[:2]
        words = k_LSKD[0, 0].numel() * k_LSKD.element_size() // 4
        block_m = triton.next_power_of_2(words)
        block_t = max(1, RECORD_WORDS // block_m)  # (one tile for any step: no compile for a new step size)
        _record_kernel[(triton.cdiv(T, block_t), layers)](
            k_LSKD.view(torch.int32), v_LSKD.view(torch.int32), slots_T, out_SL2, row_k, row_v, col_k, col_v, T,
            slots * words, words, page_size, layers, BLOCK_T=block_t, BLOCK_M=block_m, num_warps=4)


def page_sums(records_SL2: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor, page_size: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The checksums [pages, 2] (int64: row part, column part in its low 32 bits) of page `pages[i]`'s first `rows[i]`
    positions, from their records (`KVPool.sums` [S, L, 2], contiguous): one program a page. `pages`, `rows`: int32
    on the records' device. Asynchronous. `out`: where to put them (contiguous [pages, 2] int64), else new."""
    num, parts = pages.numel(), records_SL2.shape[1] * 2
    if out is None:
        out = torch.empty((num, 2), dtype=torch.int64, device=records_SL2.device)
    elif out.shape != (num, 2) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"kv_sums.page_sums: out {tuple(out.shape)} {out.dtype} is no contiguous [pages, 2] int64")
    if num:
        _page_sums_kernel[(num,)](records_SL2, pages, rows, out, page_size, parts,
                                  BLOCK_P=triton.next_power_of_2(page_size), BLOCK_R=triton.next_power_of_2(parts))
    return out
