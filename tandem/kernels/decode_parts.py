"""The pieces of paged decode attention's first stage (`decode_attention`) that its two launches share: a block of
keys and values read through a request's block table, the step's fresh queries and keys normalised and rotated,
and the online softmax over a split's blocks. Each is a `triton.jit` function the kernels inline."""

from __future__ import annotations

import triton
import triton.language as tl

from tandem.kernels.fused import _cos_sin, _round


@triton.jit
def _load_kv(k_ptr, v_ptr, pages_ptr, offs_n, mask_n, kv_head, offs_d, mask_d, stride_ks, stride_kk, stride_vs,
             stride_vk, PAGE_SIZE: tl.constexpr):
    """Keys and values [BLOCK_N, BLOCK_D] of positions offs_n (zeros where not mask_n) through the block table's
    row at pages_ptr."""
    mask_nd = mask_n[:, None] & mask_d[None, :]
    pages = tl.load(pages_ptr + offs_n // PAGE_SIZE, mask=mask_n, other=0)
    slots = pages.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE  # int64: slot * stride overflows int32
    k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_head * stride_kk + offs_d[None, :], mask=mask_nd, other=0.0)
    v = tl.load(v_ptr + slots[:, None] * stride_vs + kv_head * stride_vk + offs_d[None, :], mask=mask_nd, other=0.0)
    return k, v


@triton.jit
def _norm_rope(rows, mask_rows, offs_d, partner, w_ptr, cos, sin, eps, D: tl.constexpr, dtype: tl.constexpr,
               INTERPRET: tl.constexpr):
    """Heads [R, D] at `rows` RMS-normalised (weight at w_ptr) then rotated, each lane with its pair's lane
    (`partner`) and `sin` signed for its half: `fused.norm_rope`'s roundings, in `dtype`."""
    x = tl.load(rows + offs_d[None, :], mask=mask_rows, other=0.0).to(tl.float32)
    p = tl.load(rows + partner[None, :], mask=mask_rows, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
    x = _round(_round(x * rstd, dtype, INTERPRET).to(tl.float32) * tl.load(w_ptr + offs_d).to(tl.float32)[None, :],
               dtype, INTERPRET).to(tl.float32)
    p = _round(_round(p * rstd, dtype, INTERPRET).to(tl.float32) * tl.load(w_ptr + partner).to(tl.float32)[None, :],
               dtype, INTERPRET).to(tl.float32)
    return _round(x * cos[None, :] + p * sin[None, :], dtype, INTERPRET)


@triton.jit
def _fresh(q_rows, rows_h, lanes, b, kv_head, offs_d, k_ptr, new_k_ptr, new_v_ptr, q_norm_ptr, k_norm_ptr, pos_ptr,
           inv_freq_ptr, stride_nb, eps, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
    """(q, k_new, v_new): the raw queries at q_rows (heads rows_h) and request b's raw key for kv_head (lanes `lanes`)
    RMS-normalised then rotated (`fused.qk_norm_rope`'s arithmetic), and its value; BLOCK_D == HEAD_DIM."""
    partner = (offs_d + HEAD_DIM // 2) % HEAD_DIM  # the other half's lane, rotate-half RoPE's pair
    freq = tl.load(pos_ptr + b).to(tl.float32) * tl.load(inv_freq_ptr + offs_d % (HEAD_DIM // 2))
    cos, sin = _cos_sin(freq, INTERPRET)
    sin = tl.where(offs_d < HEAD_DIM // 2, -sin, sin)
    q = _norm_rope(q_rows, rows_h[:, None], offs_d, partner, q_norm_ptr, cos, sin, eps, HEAD_DIM,
                   k_ptr.dtype.element_ty, INTERPRET)
    new = b * stride_nb + kv_head * HEAD_DIM  # (below, `+ tl.zeros([1, 1])`: the new key as a row of one)
    k_new = tl.reshape(_norm_rope(new_k_ptr + new + tl.zeros([1, 1], tl.int32), lanes[None, :], offs_d, partner,
                                  k_norm_ptr, cos, sin, eps, HEAD_DIM, k_ptr.dtype.element_ty, INTERPRET), [BLOCK_D])
    v_new = tl.load(new_v_ptr + new + offs_d, mask=lanes, other=0.0).to(k_ptr.dtype.element_ty)
    return q, k_new, v_new


@triton.jit
def _softmax_start(q, k_ptr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """(q in the caches' dtype then the dots', and an online softmax's empty running max, sum and output)."""
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, log2 units
    return (q.to(k_ptr.dtype.element_ty).to(DOT_DTYPE), m_i, tl.zeros([BLOCK_H], tl.float32),
            tl.zeros([BLOCK_H, BLOCK_D], tl.float32))


@triton.jit
def _attend(q, k, v, mask_n, m_i, l_i, acc, qk_scale_log2, v_dtype: tl.constexpr, DOT_DTYPE: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    """One block of an online softmax: the running max m_i (log2 units), sum l_i and output acc, updated."""
    qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale_log2
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every block holds at least one valid token
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v_dtype).to(DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_blocks(q, m_i, l_i, acc, k_ptr, v_ptr, pages_ptr, first, end, seq_len, kv_head, offs_d, mask_d, stride_ks,
                   stride_kk, stride_vs, stride_vk, k_new, v_new, qk_scale_log2, PAGE_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, FRESH: tl.constexpr):
    """`_attend` over the blocks of positions [first, end), read through the block table's row at pages_ptr (with
    FRESH, the newest position's key and value are k_new, v_new)."""
    for block_start in range(first, end, BLOCK_N):
        offs_n = block_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        k, v = _load_kv(k_ptr, v_ptr, pages_ptr, offs_n, mask_n, kv_head, offs_d, mask_d, stride_ks, stride_kk,
                        stride_vs, stride_vk, PAGE_SIZE)
        if FRESH:
            newest = offs_n == seq_len - 1
            k, v = tl.where(newest[:, None], k_new[None, :], k), tl.where(newest[:, None], v_new[None, :], v)
        m_i, l_i, acc = _attend(q, k, v, mask_n, m_i, l_i, acc, qk_scale_log2, v_ptr.dtype.element_ty, DOT_DTYPE,
                                DOT_PRECISION)
    return m_i, l_i, acc
