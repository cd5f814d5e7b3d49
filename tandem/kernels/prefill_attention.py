"""Paged-attention prefill in Triton: variable-length chunks of new query tokens against their paged KV cache.

Each sequence b brings a chunk of q_len_b new tokens (contiguous in the flat batch, from `q_starts_B1[b]`),
whose keys and values are already written to the cache; query j of the chunk sits at position
kv_len_b - q_len_b + j and attends causally to positions 0 .. that position (a cached prefix, then the chunk).

One program per (sequence, query block of BLOCK_M tokens, kv head), for all G query heads of that kv head's
group at once: the block's BLOCK_M tokens x G heads are packed into the dot's M dimension (row r is token
r // G_PAD, head r % G_PAD), so each KV block is read once per group, not once per query head. The program runs
flash-attention's online softmax (fp32 running max, sum and accumulator) over KV blocks of BLOCK_N positions,
found through the block table:
  - positions before the block's first query are visible to every row: those KV blocks need no position mask;
  - the blocks from there to the block's last query position are masked causally per row (and at the tail);
  - nothing past the block's last query position is read (the causal limit ends the loop).
Programs whose query block starts past their sequence's chunk (the grid is sized for `max_q_len`) exit at once.

No host syncs: the grid is (B, cdiv(max_q_len, BLOCK_M), K), from host-known values; everything else (chunk
bounds, context lengths, pages) is read on the device. Or the grid is a given tile list, (N, 1, K): program n
takes sequence tiles[0, n]'s query block tiles[1, n]. A CUDA graph captures a fixed grid for any batch that way:
N = `max_tiles(...)` covers every chunk's blocks, the rest of the list points at an empty (padding) sequence.

Any even head dim up to 256 (`limits.py`): a head is loaded into a power-of-two block (`head_block`), the
lanes past D masked off (zeros in, nothing out).

Shapes: T flat query tokens, B sequences, H query heads, K kv heads, G = H // K, D head dim, S cache slots,
P pages per sequence (block table width).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tandem.kernels.fused import varying
from tandem.kernels.limits import attention_shape_error, head_block

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
DEFAULT_ROWS = 128  # (query token, head) rows per program: BLOCK_M = DEFAULT_ROWS // G_PAD tokens
MIN_ROWS = 16  # tl.dot needs M >= 16


def choose_blocks(group: int, head_dim: int, cache_dtype: torch.dtype, block_m: int | None = None,
                  block_n: int | None = None) -> tuple[int, int, int]:
    """(block_m query tokens, block_n KV positions, num_warps) of a launch. By default a program holds about
    DEFAULT_ROWS (token, head) rows; block_n is 64, or 32 for fp32 caches at head_dim > 64 (two pipeline
    stages of 64 x 128 fp32 K and V tiles would need ~160 KiB of shared memory). A given block_m is raised so
    that the rows fill tl.dot's minimum M."""
    group_pad = triton.next_power_of_2(group)
    if block_m is None:
        block_m = max(1, DEFAULT_ROWS // group_pad)
    block_m = max(block_m, triton.cdiv(MIN_ROWS, group_pad))
    assert block_m & (block_m - 1) == 0, f"block_m {block_m}: must be a power of two"
    if block_n is None:
        block_n = 32 if cache_dtype == torch.float32 and head_dim > 64 else 64
    assert block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n {block_n}: a power of two >= 16"
    num_warps = 8 if block_m * group_pad * head_block(head_dim) >= 128 * 128 else 4
    return block_m, block_n, num_warps


@triton.jit(**varying("stride_tiles", "stride_bt"))
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_table_ptr, q_starts_ptr, kv_lens_ptr, tiles_ptr, stride_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kk, stride_vs, stride_vk, stride_bt,
    qk_scale_log2,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TILED: tl.constexpr,
):
    b, q_block, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if TILED:
        b, q_block = tl.load(tiles_ptr + b), tl.load(tiles_ptr + stride_tiles + b)
    q_start = tl.load(q_starts_ptr + b)
    q_len = tl.load(q_starts_ptr + b + 1) - q_start
    block_start = q_block * BLOCK_M
    if block_start >= q_len:  # the grid covers max_q_len; this sequence's chunk is shorter
        return
    kv_len = tl.load(kv_lens_ptr + b)
    prefix = kv_len - q_len  # positions before the chunk

    ROWS: tl.constexpr = BLOCK_M * GROUP_PAD
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d[None, :] < HEAD_DIM
    tok = block_start + offs_r // GROUP_PAD  # index of the row's token within the chunk
    head = offs_r % GROUP_PAD  # index within the group
    mask_r = (tok < q_len) & (head < GROUP)
    q_pos = prefix + tok  # the row's position; padding rows get positions past the block's end (harmless)
    heads = kv_head * GROUP + head
    tokens = (q_start + tok).to(tl.int64)

    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_r[:, None] & mask_d, other=0.0)
    q = q.to(k_ptr.dtype.element_ty).to(DOT_DTYPE)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    bt_row = block_table_ptr + b * stride_bt

    # Stage 1: whole blocks before the block's first query position, visible to every row: no position masks.
    first_pos = prefix + block_start
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    for kv_start in range(0, full_end, BLOCK_N):
        offs_n = kv_start + tl.arange(0, BLOCK_N)
        pages = tl.load(bt_row + offs_n // PAGE_SIZE)
        slots = pages.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE  # int64: slot * stride overflows int32
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_head * stride_kk + offs_d[None, :], mask=mask_d,
                    other=0.0).to(DOT_DTYPE)
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kv_head * stride_vk + offs_d[None, :], mask=mask_d,
                    other=0.0).to(DOT_DTYPE)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Stage 2: from there up to the block's last query position (the causal limit), masked per row. The first
    # of these blocks holds position full_end <= first_pos, visible to every row, so m_i is finite after it.
    end = prefix + tl.minimum(block_start + BLOCK_M, q_len)
    for kv_start in range(full_end, end, BLOCK_N):
        offs_n = kv_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        pages = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        slots = pages.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_head * stride_kk + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d, other=0.0).to(DOT_DTYPE)
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kv_head * stride_vk + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d, other=0.0).to(DOT_DTYPE)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        visible = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_d)


def paged_prefill_attention(q_THD: torch.Tensor, k_cache_SKD: torch.Tensor, v_cache_SKD: torch.Tensor,
                            block_table_BP: torch.Tensor, q_starts_B1: torch.Tensor, kv_lens_B: torch.Tensor,
                            page_size: int, scale: float, max_q_len: int, block_m: int | None = None,
                            block_n: int | None = None, tiles_2N: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's chunk of new tokens over its cached prefix and the chunk itself.

    q_THD: the flat batch's queries (any float dtype; the output has the same dtype). Sequence b's queries are
      rows q_starts_B1[b] .. q_starts_B1[b + 1] - 1; rows outside every sequence are left unwritten.
    k_cache_SKD, v_cache_SKD: one layer's slot-major cache (e.g. `pool.k_cache[layer]`), bf16 or fp32, last dim
      contiguous; slot = page * page_size + offset. The chunk's own K/V must already be written.
    block_table_BP: int32 page ids per sequence, padded with any value past the sequence's last page.
    q_starts_B1: int32 cumulative query offsets, length B + 1 (an empty chunk, q_len 0, is a padding row).
    kv_lens_B: int32 positions each sequence attends to, its chunk included (so kv_lens_B[b] >= q_len_b and
      kv_lens_B[b] <= P * page_size). Query j of sequence b sits at position kv_lens_B[b] - q_len_b + j.
    max_q_len: host int >= every q_len_b, sizes the grid (no host sync on q_starts_B1).
    block_m: query tokens per program (default DEFAULT_ROWS // next_pow2(G)); block_n: KV positions per
      inner iteration (default by head dim). Both powers of two.
    tiles_2N: int32 (sequence, query block of block_m tokens) per program, as from `fill_tiles`; replaces the
      grid that max_q_len sizes (which it then ignores).
    Accumulates in fp32; reads only the KV at positions <= each query's own (never past kv_lens_B[b]).
    """
    T, H, D = q_THD.shape
    _, K, _ = k_cache_SKD.shape
    B = kv_lens_B.shape[0]
    assert (error := attention_shape_error(D, H, K)) is None, error
    assert page_size > 0 and page_size & (page_size - 1) == 0, f"page_size {page_size}: must be a power of two"
    assert k_cache_SKD.shape == v_cache_SKD.shape and k_cache_SKD.dtype == v_cache_SKD.dtype
    assert k_cache_SKD.shape[2] == D
    assert k_cache_SKD.dtype in (torch.bfloat16, torch.float32), k_cache_SKD.dtype
    assert k_cache_SKD.stride(2) == 1 and v_cache_SKD.stride(2) == 1 and q_THD.stride(2) == 1
    assert block_table_BP.dtype == torch.int32 and q_starts_B1.dtype == torch.int32
    assert kv_lens_B.dtype == torch.int32
    assert block_table_BP.shape[0] == B and q_starts_B1.shape == (B + 1,) and block_table_BP.stride(1) == 1
    assert q_starts_B1.is_contiguous() and kv_lens_B.is_contiguous()
    assert tiles_2N is None or (tiles_2N.dtype == torch.int32 and tiles_2N.shape[0] == 2 and tiles_2N.stride(1) == 1)
    o_THD = torch.empty_like(q_THD, memory_format=torch.contiguous_format)
    if B == 0 or T == 0 or (max_q_len <= 0 if tiles_2N is None else tiles_2N.shape[1] == 0):
        return o_THD
    group = H // K
    block_m, block_n, num_warps = choose_blocks(group, D, k_cache_SKD.dtype, block_m, block_n)

    dot_precision = "ieee" if k_cache_SKD.dtype == torch.float32 else "tf32"  # no tf32 rounding of fp32 caches
    # The CPU interpreter multiplies bf16 dot operands as raw integers: it gets them upcast (exactly, after the
    # same rounding to the cache dtype), so it computes what the GPU computes.
    dot_dtype = tl.float32 if triton.knobs.runtime.interpret else _TL_DTYPES[k_cache_SKD.dtype]
    if tiles_2N is None:
        grid, tiles, tiles_stride = (B, triton.cdiv(max_q_len, block_m), K), q_starts_B1, 0
    else:
        grid, tiles, tiles_stride = (tiles_2N.shape[1], 1, K), tiles_2N, tiles_2N.stride(0)
    _prefill_kernel[grid](
        q_THD, k_cache_SKD, v_cache_SKD, o_THD, block_table_BP, q_starts_B1, kv_lens_B, tiles, tiles_stride,
        q_THD.stride(0), q_THD.stride(1), o_THD.stride(0), o_THD.stride(1),
        k_cache_SKD.stride(0), k_cache_SKD.stride(1), v_cache_SKD.stride(0), v_cache_SKD.stride(1),
        block_table_BP.stride(0), scale * math.log2(math.e),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=D, BLOCK_D=head_block(D),
        PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,
        TILED=tiles_2N is not None, num_warps=num_warps, num_stages=2,
    )
    return o_THD


def max_tiles(num_tokens: int, num_seqs: int, block_m: int) -> int:
    """Tiles enough for any batch of at most `num_tokens` query tokens in at most `num_seqs` sequences: each
    sequence's last block may be partial."""
    return triton.cdiv(num_tokens, block_m) + min(num_seqs, num_tokens)


def fill_tiles(q_lens: list[int], block_m: int, num_tiles: int, pad_seq: int) -> torch.Tensor:
    """int32 [2, num_tiles] on the host: (sequence, query block) for every block of every chunk, then
    (pad_seq, 0) -- a sequence with an empty chunk, whose programs exit at once."""
    seqs = [b for b, n in enumerate(q_lens) for _ in range(triton.cdiv(n, block_m))]
    blocks = [j for n in q_lens for j in range(triton.cdiv(n, block_m))]
    assert len(seqs) <= num_tiles, f"{len(seqs)} tiles do not fit in {num_tiles}"
    pad = num_tiles - len(seqs)
    return torch.tensor([seqs + [pad_seq] * pad, blocks + [0] * pad], dtype=torch.int32)
