"""Paged-attention decode in Triton: one new query token per request against its paged KV cache.

Split-KV in two stages, the design of SGLang's and vLLM's Triton decode kernels:
  - stage 1, one program per (request, kv head, split): the split's slice of the context, for all query heads
    of that kv head's group at once (the group is packed into the dot's M dimension, so each KV block is read
    once per group, not once per query head); writes the split's normalised partial output and its
    log-sum-exp.
  - stage 2, one program per (request, query head): merges the splits by their log-sum-exps.
Splitting the context lets a small batch fill the GPU; see `choose_num_kv_splits`. Where a graph's split count
(fixed for the longest context it may see) would leave most of stage 1's programs past their requests' ends,
stage 1 instead launches one program a work item (a split that holds a position), each finding its request and
split from the step's lengths (`_items_kernel`, `first_stage_programs`). Stage 1 is a programmatic
dependent launch that loads what the kernel before it does not write (the step's lengths and pages, the first
block's older keys and values) before waiting for it. With `fresh`, stage 1 also applies q/k RMSNorm and RoPE to
the step's queries and new keys and writes the new keys and values into the cache (the decode step's last
per-layer work before attention, which a few-row step would otherwise do in its q/k/v projection).

CUDA-graph safe: everything the launch depends on (grid, compile-time constants, scratch shapes) comes from
tensor shapes and arguments, never from tensor values; the per-request work follows `seq_lens_B` on the device,
and splits that fall past a request's end (or a whole request with seq_len 0) do no reads.

Any even head dim up to 256 (`limits.py`): a head is loaded into a power-of-two block (`head_block`), the
lanes past D masked off (zeros in, nothing out).

Shapes: B requests, H query heads, K kv heads, G = H // K heads per group, D head dim, S cache slots,
P pages per request (block table width), N splits.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from tandem.kernels.decode_parts import _attend, _attend_blocks, _fresh, _load_kv, _softmax_start
from tandem.kernels.fused import gdc_launch_dependents, gdc_wait, pdl_supported, rope_inv_freq, varying
from tandem.kernels.limits import attention_shape_error, head_block, takes_fresh

if TYPE_CHECKING:
    from tandem.model.attention import Fresh

MIN_TOKENS_PER_SPLIT = 64  # below this a split's fixed cost (q load, merge traffic) outweighs its parallelism
# At run time a split holds at least the batch's context tokens over this many programs an SM (the graph's split
# count is an upper bound for the longest context), but at most MAX_BALANCED_SPLIT tokens: few requests' splits
# stay few and long, and no program of a large batch is long enough to leave a tail (BENCHMARKS.md, "Few-row kernels")
BALANCED_PROGRAMS_PER_SM, MAX_BALANCED_SPLIT = 4, 512
MAX_KV_SPLITS = 64
LOOP_SAVES = 6  # `_items_kernel` runs the first stage where that launches this many times fewer programs
LENS_BLOCK = 256  # requests whose lengths stage 1 loads at once to sum the batch's context tokens
# Decode is bandwidth-bound, and a batch's contexts differ in length: many programs per SM keep enough loads in
# flight and leave no long tail of the longest contexts' programs (BENCHMARKS.md, "Decode attention", has the sweep)
PROGRAMS_PER_SM = 32
# A few requests at a time take few programs: each one's fixed work (its queries, the merge's reads of its partials)
# outweighs the balance many programs buy (BENCHMARKS.md, "Few-row kernels", has the A/B)
SMALL_BATCH, SMALL_BATCH_PROGRAMS_PER_SM = 4, 2
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def choose_num_kv_splits(batch_size: int, num_kv_heads: int, max_len: int, num_sms: int) -> int:
    """How many splits to cut each request's context into, from host-known values only (so the choice is fixed
    for a captured CUDA graph): enough (request, kv head, split) programs to give every SM `PROGRAMS_PER_SM`
    (`SMALL_BATCH_PROGRAMS_PER_SM` up to `SMALL_BATCH` requests),
    but no split shorter than `MIN_TOKENS_PER_SPLIT` of the longest possible context, at most `MAX_KV_SPLITS`,
    rounded down to a power of two so few distinct values (and stage-2 compilations) occur."""
    per_sm = SMALL_BATCH_PROGRAMS_PER_SM if batch_size <= SMALL_BATCH else PROGRAMS_PER_SM
    wanted = triton.cdiv(per_sm * num_sms, max(1, batch_size * num_kv_heads))
    splits = max(1, min(wanted, triton.cdiv(max_len, MIN_TOKENS_PER_SPLIT), MAX_KV_SPLITS))
    return 1 << (splits.bit_length() - 1)


def first_stage_programs(batch_size: int, num_splits: int, split_programs: int, fresh: bool) -> tuple[int, bool]:
    """(programs a kv head, whether `_items_kernel` runs them) of the first stage: one for each split of every
    request, unless with the balance (split_programs > 0) that is `LOOP_SAVES` times more than the work items the
    balance makes while its floor binds (split_programs, and one more a request at most: its last split's rounding);
    then one an item (where the cap binds, more items than programs: each computes its items in turn). Never with
    fresh keys (a step of `small_linear.FRESH_ROWS` rows at most: few programs)."""
    programs = batch_size * num_splits
    balanced = split_programs + batch_size
    if split_programs == 0 or fresh or balanced * LOOP_SAVES > programs:
        return programs, False
    return balanced, True


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the CPU interpreter: fewer programs run faster
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit(**varying("stride_bt", "num_splits", "split_programs", "max_balanced"))
def _split_kernel(
    q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    stride_qb, stride_qh, stride_ks, stride_kk, stride_vs, stride_vk, stride_bt, num_splits, split_programs,
    max_balanced, qk_scale_log2,
    new_k_ptr, new_v_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, inv_freq_ptr, slots_ptr, stride_nb, eps,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr, FRESH: tl.constexpr, LENS_BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    """FRESH: q_ptr holds the step's raw queries, new_k_ptr / new_v_ptr its raw keys and values ([B, K, D] at
    row stride stride_nb); q/k RMSNorm and RoPE are applied here (`fused.qk_norm_rope`'s arithmetic), and the
    program whose split holds the newest position writes its key and value into the caches at slots_ptr[b],
    using them from registers. Else the kernel before wrote them there. split_programs > 0: a split holds at
    least min(sum(seq_lens) / split_programs, max_balanced) tokens (whole blocks), so the batch's programs per kv
    head are about split_programs, of about equal length, unless that cap binds; 0: every request's context is cut
    into num_splits."""
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h

    # Before the wait for the kernel before (PDL), what it does not write: the step's inputs (written before the
    # kernels before it ran) and the first block's keys and values but the newest position's (which it writes).
    seq_len = tl.load(seq_lens_ptr + b)
    least = _least(seq_lens_ptr, tl.num_programs(0), split_programs, max_balanced, LENS_BLOCK)
    # split lengths are whole blocks so no block straddles two splits
    tokens_per_split = tl.cdiv(tl.maximum(tl.cdiv(seq_len, num_splits), least), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    offs_n = start + tl.arange(0, BLOCK_N)
    k, v = _load_kv(k_ptr, v_ptr, block_table_ptr + b * stride_bt, offs_n, offs_n < tl.minimum(end, seq_len - 1),
                    kv_head, offs_d, mask_d, stride_ks, stride_kk, stride_vs, stride_vk, PAGE_SIZE)
    if PDL:  # a dependent launch: nothing the kernel before writes is read before it is done
        gdc_wait()
        gdc_launch_dependents()
    newest = offs_n == seq_len - 1
    work = start < end  # else a split past the request's end: it reads nothing and writes only its lse
    # (as vectors, not `mask & work`: the CPU interpreter takes no scalar in a mask)
    rows_h = offs_h < tl.where(work, GROUP, 0)  # the group's heads; none in an empty split
    lanes = offs_d < tl.where(work, BLOCK_D, 0)
    k_new = tl.zeros([BLOCK_D], k_ptr.dtype.element_ty)
    v_new = k_new
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    if FRESH:  # (BLOCK_D == HEAD_DIM)
        q, k_new, v_new = _fresh(q_rows, rows_h, lanes, b, kv_head, offs_d, k_ptr, new_k_ptr, new_v_ptr, q_norm_ptr,
                                 k_norm_ptr, pos_ptr, inv_freq_ptr, stride_nb, eps, HEAD_DIM, BLOCK_D, INTERPRET)
        if start <= seq_len - 1 and seq_len - 1 < end:  # this split holds the newest position: it writes it
            slot = tl.load(slots_ptr + b).to(tl.int64)
            tl.store(k_ptr + slot * stride_ks + kv_head * stride_kk + offs_d, k_new)
            tl.store(v_ptr + slot * stride_vs + kv_head * stride_vk + offs_d, v_new)
    else:
        if start <= seq_len - 1 and seq_len - 1 < start + BLOCK_N:  # the first block holds the newest position
            k_now, v_now = _load_kv(k_ptr, v_ptr, block_table_ptr + b * stride_bt, offs_n, newest, kv_head, offs_d,
                                    mask_d, stride_ks, stride_kk, stride_vs, stride_vk, PAGE_SIZE)
            k, v = tl.where(newest[:, None], k_now, k), tl.where(newest[:, None], v_now, v)
        q = tl.load(q_rows + offs_d[None, :], mask=rows_h[:, None] & mask_d[None, :], other=0.0)
    q, m_i, l_i, acc = _softmax_start(q, k_ptr, BLOCK_H, BLOCK_D, DOT_DTYPE)
    if work:
        if FRESH:
            k, v = tl.where(newest[:, None], k_new[None, :], k), tl.where(newest[:, None], v_new[None, :], v)
        m_i, l_i, acc = _attend(q, k, v, offs_n < end, m_i, l_i, acc, qk_scale_log2, v_ptr.dtype.element_ty,
                                DOT_DTYPE, DOT_PRECISION)
    m_i, l_i, acc = _attend_blocks(q, m_i, l_i, acc, k_ptr, v_ptr, block_table_ptr + b * stride_bt, start + BLOCK_N,
                                   end, seq_len, kv_head, offs_d, mask_d, stride_ks, stride_kk, stride_vs, stride_vk,
                                   k_new, v_new, qk_scale_log2, PAGE_SIZE, BLOCK_N, DOT_DTYPE, DOT_PRECISION, FRESH)

    # an empty split (past the request's end) leaves l_i == 0: it writes lse = -inf and no output, which stage 2
    # then neither weighs nor reads
    nonempty = l_i > 0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split  # scratch is [B, H, N(, D)], contiguous
    tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o,
             mask=(mask_h & nonempty)[:, None] & mask_d[None, :])
    tl.store(mid_lse_ptr + row, lse, mask=mask_h)


@triton.jit
def _least(seq_lens_ptr, B, split_programs, max_balanced, LENS_BLOCK: tl.constexpr):
    """The fewest tokens a split holds: the batch's context tokens over split_programs, at most max_balanced; 0
    with split_programs 0 (none read then; one load of up to LENS_BLOCK requests' lengths)."""
    lens = tl.zeros([LENS_BLOCK], tl.int32)
    for first in range(0, tl.where(split_programs > 0, B, 0), LENS_BLOCK):
        rows = first + tl.arange(0, LENS_BLOCK)
        lens += tl.load(seq_lens_ptr + rows, mask=rows < B, other=0)
    return tl.where(split_programs > 0,
                    tl.minimum(tl.cdiv(tl.sum(lens, 0), tl.maximum(split_programs, 1)), max_balanced), 0)


@triton.jit
def _split_tokens(seq_len, num_splits, least, BLOCK_N: tl.constexpr):
    """The tokens of each of a context's splits: whole blocks, so no block straddles two splits."""
    return tl.maximum(tl.cdiv(tl.maximum(tl.cdiv(seq_len, num_splits), least), BLOCK_N), 1) * BLOCK_N


@triton.jit
def _locate(seq_lens_ptr, B, item, num_splits, least, BLOCK_N: tl.constexpr, LENS_BLOCK: tl.constexpr):
    """(request, split, count of items) of work item `item`: the splits that hold a position, by request (-1: none)."""
    b, split, items = item * 0 - 1, item * 0, item * 0
    for first in range(0, B, LENS_BLOCK):
        rows = first + tl.arange(0, LENS_BLOCK)
        lens = tl.load(seq_lens_ptr + rows, mask=rows < B, other=0)
        counts = tl.cdiv(lens, _split_tokens(lens, num_splits, least, BLOCK_N))
        ends = items + tl.cumsum(counts, 0)  # where each request's items end
        hit = (ends - counts <= item) & (item < ends)
        b = tl.maximum(b, tl.max(tl.where(hit, rows, -1), 0))
        split += tl.sum(tl.where(hit, item - (ends - counts), 0), 0)
        items += tl.sum(counts, 0)
    return b, split, items


@triton.jit
def _attend_split(q_ptr, k_ptr, v_ptr, pages_ptr, mid_o_ptr, mid_lse_ptr, b, split, seq_len, start, end, k, v,
                  kv_head, num_kv_heads, stride_qb, stride_qh, stride_ks, stride_kk, stride_vs, stride_vk, num_splits,
                  qk_scale_log2, new_k_ptr, new_v_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, inv_freq_ptr, slots_ptr,
                  stride_nb, eps, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, FRESH: tl.constexpr, INTERPRET: tl.constexpr):
    """Request b's split [start, end) (at least one position), its first block's keys and values k, v given but for
    the newest position: writes the split's normalised output and log-sum-exp (and with FRESH, if the split holds
    the newest position, that position's key and value into the caches)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    offs_n = start + tl.arange(0, BLOCK_N)
    newest = offs_n == seq_len - 1
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    if FRESH:  # (BLOCK_D == HEAD_DIM)
        q, k_new, v_new = _fresh(q_rows, mask_h, mask_d, b, kv_head, offs_d, k_ptr, new_k_ptr, new_v_ptr, q_norm_ptr,
                                 k_norm_ptr, pos_ptr, inv_freq_ptr, stride_nb, eps, HEAD_DIM, BLOCK_D, INTERPRET)
        if seq_len - 1 < end:  # this split holds the newest position: it writes it
            slot = tl.load(slots_ptr + b).to(tl.int64)
            tl.store(k_ptr + slot * stride_ks + kv_head * stride_kk + offs_d, k_new)
            tl.store(v_ptr + slot * stride_vs + kv_head * stride_vk + offs_d, v_new)
        k, v = tl.where(newest[:, None], k_new[None, :], k), tl.where(newest[:, None], v_new[None, :], v)
    else:
        k_new = tl.zeros([BLOCK_D], k_ptr.dtype.element_ty)  # (unread)
        v_new = k_new
        if seq_len - 1 < start + BLOCK_N:  # the first block holds the newest position
            k_now, v_now = _load_kv(k_ptr, v_ptr, pages_ptr, offs_n, newest, kv_head, offs_d, mask_d, stride_ks,
                                    stride_kk, stride_vs, stride_vk, PAGE_SIZE)
            k, v = tl.where(newest[:, None], k_now, k), tl.where(newest[:, None], v_now, v)
        q = tl.load(q_rows + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    q, m_i, l_i, acc = _softmax_start(q, k_ptr, BLOCK_H, BLOCK_D, DOT_DTYPE)
    m_i, l_i, acc = _attend(q, k, v, offs_n < end, m_i, l_i, acc, qk_scale_log2, v_ptr.dtype.element_ty, DOT_DTYPE,
                            DOT_PRECISION)
    m_i, l_i, acc = _attend_blocks(q, m_i, l_i, acc, k_ptr, v_ptr, pages_ptr, start + BLOCK_N, end, seq_len, kv_head,
                                   offs_d, mask_d, stride_ks, stride_kk, stride_vs, stride_vk, k_new, v_new,
                                   qk_scale_log2, PAGE_SIZE, BLOCK_N, DOT_DTYPE, DOT_PRECISION, FRESH)
    row = (b * num_kv_heads * GROUP + heads) * num_splits + split  # scratch is [B, H, N(, D)], contiguous
    tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None],
             mask=mask_h[:, None] & mask_d[None, :])
    tl.store(mid_lse_ptr + row, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit(**varying("num_requests", "stride_bt", "num_splits", "split_programs", "max_balanced"))
def _items_kernel(
    q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr, num_requests,
    stride_qb, stride_qh, stride_ks, stride_kk, stride_vs, stride_vk, stride_bt, num_splits, split_programs,
    max_balanced, qk_scale_log2,
    new_k_ptr, new_v_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, inv_freq_ptr, slots_ptr, stride_nb, eps,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr, FRESH: tl.constexpr, LENS_BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    """`_split_kernel`'s work (its arguments, and num_requests), launched as one program a work item where most of
    its (request, split) programs would have none: program (p, kv head) computes `_locate`'s items p, p + P, ...
    in turn (P programs; the items are the splits that hold a position, request by request). Only the splits that
    hold a position are written; a program with no item neither waits for the kernel before nor writes."""
    pid, kv_head = tl.program_id(0), tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    least = _least(seq_lens_ptr, num_requests, split_programs, max_balanced, LENS_BLOCK)  # (step inputs: before
    _b, _split, items = _locate(seq_lens_ptr, num_requests, pid, num_splits, least, BLOCK_N, LENS_BLOCK)  # the wait)
    if PDL:  # a dependent launch: nothing the kernel before writes is read before it is done
        if pid < items:
            gdc_wait()
        gdc_launch_dependents()
    for item in range(pid, items, tl.num_programs(0)):
        b_i, split_i, _ = _locate(seq_lens_ptr, num_requests, item, num_splits, least, BLOCK_N, LENS_BLOCK)
        len_i = tl.load(seq_lens_ptr + b_i)
        tokens_i = _split_tokens(len_i, num_splits, least, BLOCK_N)
        start_i = split_i * tokens_i
        offs_i = start_i + tl.arange(0, BLOCK_N)
        pages_i = block_table_ptr + b_i * stride_bt
        k_i, v_i = _load_kv(k_ptr, v_ptr, pages_i, offs_i, offs_i < tl.minimum(len_i - 1, start_i + tokens_i),
                            kv_head, offs_d, mask_d, stride_ks, stride_kk, stride_vs, stride_vk, PAGE_SIZE)
        _attend_split(q_ptr, k_ptr, v_ptr, pages_i, mid_o_ptr, mid_lse_ptr, b_i, split_i, len_i, start_i,
                      tl.minimum(start_i + tokens_i, len_i), k_i, v_i, kv_head, tl.num_programs(1), stride_qb,
                      stride_qh, stride_ks, stride_kk, stride_vs, stride_vk, num_splits, qk_scale_log2, new_k_ptr,
                      new_v_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, inv_freq_ptr, slots_ptr, stride_nb, eps, GROUP,
                      HEAD_DIM, BLOCK_D, PAGE_SIZE, BLOCK_H, BLOCK_N, DOT_DTYPE, DOT_PRECISION, FRESH, INTERPRET)


@triton.jit(**varying("num_splits", "split_programs", "max_balanced"))
def _merge_kernel(
    mid_o_ptr, mid_lse_ptr, o_ptr, seq_lens_ptr, stride_ob, stride_oh, num_splits, split_programs, max_balanced,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
    LENS_BLOCK: tl.constexpr, LOOP: tl.constexpr, PDL: tl.constexpr,
):
    """Program (request, query head) merges the splits the first stage wrote: with LOOP the splits that hold a
    position (worked out from the lengths; the others are not written), else those with a finite log-sum-exp."""
    b, head = tl.program_id(0), tl.program_id(1)
    used = num_splits
    if LOOP:  # (step inputs: read before the wait)
        seq_len = tl.load(seq_lens_ptr + b)
        least = _least(seq_lens_ptr, tl.num_programs(0), split_programs, max_balanced, LENS_BLOCK)
        used = tl.cdiv(seq_len, _split_tokens(seq_len, num_splits, least, BLOCK_N))
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs_n = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < used
    mask_d = offs_d < HEAD_DIM
    row = (b * tl.num_programs(1) + head) * num_splits + offs_n
    lse = tl.load(mid_lse_ptr + row, mask=mask_n, other=float("-inf"))
    written = mask_n & (lse > float("-inf"))
    o_split = tl.load(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=written[:, None] & mask_d[None, :],
                      other=0.0)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # seq_len 0: no split, every weight 0, output 0
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    o = tl.sum(o_split * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * stride_ob + head * stride_oh + offs_d, o.to(o_ptr.dtype.element_ty), mask=mask_d)


def paged_decode_attention(q_BHD: torch.Tensor, k_cache_SKD: torch.Tensor, v_cache_SKD: torch.Tensor,
                           block_table_BP: torch.Tensor, seq_lens_B: torch.Tensor, page_size: int, scale: float,
                           num_kv_splits: int | None = None, block_n: int | None = None, *, num_warps: int = 4,
                           num_stages: int = 2, fresh: Fresh | None = None) -> torch.Tensor:
    """Attention of one query token per request over its first `seq_lens_B[b]` cached positions.

    q_BHD: the new tokens' queries (any float dtype; the output has the same dtype).
    k_cache_SKD, v_cache_SKD: one layer's slot-major cache (e.g. `pool.k_cache[layer]`), bf16 or fp32, last dim
      contiguous; slot = page * page_size + offset. The new token's K/V must already be written.
    block_table_BP: int32 page ids per request, padded with any valid page id (e.g. 0) past the request's end.
    seq_lens_B: int32 positions each request attends to (new token included); 0 marks a padding row, whose
      output is zeros. Requires seq_lens_B[b] <= P * page_size.
    num_kv_splits: splits of each context; default `choose_num_kv_splits` from B, K and P * page_size, and then
      each split at least the batch's context tokens over `BALANCED_PROGRAMS_PER_SM` programs an SM (at most
      `MAX_BALANCED_SPLIT`), so a short context takes fewer splits than that (the rest do no reads).
    block_n: tokens per inner iteration (a tuning knob; default by head dim), as are num_warps and num_stages.
    fresh: the new tokens' keys and values are not yet in the caches, and q_BHD, k and v are as the q/k/v
      projection gives them: q/k RMSNorm and RoPE run here (as `fused.qk_norm_rope`, whose arithmetic and
      roundings they follow), and the new keys and values are written into the caches at `fresh.slots_B` (padding
      rows, seq_len 0, write nothing). q, k, v and the caches of one dtype; `takes_fresh(D)`;
      `fused.rope_inv_freq`'s first call per (D, theta, device) before any CUDA-graph capture.
    Accumulates in fp32; reads only the KV of positions < seq_lens_B[b]; launches a fixed grid (graph safe).
    """
    B, H, D = q_BHD.shape
    _, K, _ = k_cache_SKD.shape
    assert (error := attention_shape_error(D, H, K)) is None, error
    assert page_size > 0 and page_size & (page_size - 1) == 0, f"page_size {page_size}: must be a power of two"
    assert k_cache_SKD.shape == v_cache_SKD.shape and k_cache_SKD.dtype == v_cache_SKD.dtype
    assert k_cache_SKD.shape[2] == D
    assert k_cache_SKD.dtype in (torch.bfloat16, torch.float32), k_cache_SKD.dtype
    assert k_cache_SKD.stride(2) == 1 and v_cache_SKD.stride(2) == 1 and q_BHD.stride(2) == 1
    assert block_table_BP.dtype == torch.int32 and seq_lens_B.dtype == torch.int32
    assert block_table_BP.shape[0] == B and seq_lens_B.shape == (B,) and block_table_BP.stride(1) == 1
    new = (q_BHD,) * 6 + (seq_lens_B, 0, 0.0)  # (new k, v, norms, positions, inv_freq, slots, stride, eps: unread)
    if fresh is not None:
        k, v = fresh.k_BKD, fresh.v_BKD
        assert takes_fresh(D) and k.shape == v.shape == (B, K, D) and k.stride() == v.stride(), (k.shape, v.shape, D)
        assert k.stride(1) == D and k.stride(2) == 1 and q_BHD.dtype == k.dtype == v.dtype == k_cache_SKD.dtype
        assert fresh.q_norm.shape == fresh.k_norm.shape == (D,) and fresh.positions_B.shape == (B,), D
        assert fresh.slots_B.shape == (B,) and k_cache_SKD.is_contiguous() and v_cache_SKD.is_contiguous()
        new = (k, v, fresh.q_norm, fresh.k_norm, fresh.positions_B, rope_inv_freq(D, fresh.theta, q_BHD.device),
               fresh.slots_B, k.stride(0), fresh.eps)
    o_BHD = torch.empty_like(q_BHD, memory_format=torch.contiguous_format)
    if B == 0:
        return o_BHD
    split_programs = 0  # (an explicit split count: every context cut into exactly that many)
    if num_kv_splits is None:
        max_len = block_table_BP.shape[1] * page_size
        num_kv_splits = choose_num_kv_splits(B, K, max_len, _num_sms(q_BHD.device))
        split_programs = BALANCED_PROGRAMS_PER_SM and max(1, BALANCED_PROGRAMS_PER_SM * _num_sms(q_BHD.device) // K)
    block_n = block_n or (64 if D <= 64 else 32)
    group = H // K

    mid_o_BHND = torch.empty(B, H, num_kv_splits, D, dtype=torch.float32, device=q_BHD.device)
    mid_lse_BHN = torch.empty(B, H, num_kv_splits, dtype=torch.float32, device=q_BHD.device)
    dot_precision = "ieee" if k_cache_SKD.dtype == torch.float32 else "tf32"  # no tf32 rounding of fp32 caches
    # The CPU interpreter multiplies bf16 dot operands as raw integers: it gets them upcast (exactly, after the
    # same rounding to the cache dtype), so it computes what the GPU computes.
    dot_dtype = tl.float32 if triton.knobs.runtime.interpret else _TL_DTYPES[k_cache_SKD.dtype]
    pdl = pdl_supported(q_BHD.device)  # both stages launch while the kernel before them finishes
    launch = {"launch_pdl": True} if pdl else {}
    programs, loop = first_stage_programs(B, num_kv_splits, split_programs, fresh is not None)
    common = dict(GROUP=group, HEAD_DIM=D, BLOCK_D=head_block(D), PAGE_SIZE=page_size,
                  BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, DOT_DTYPE=dot_dtype,
                  DOT_PRECISION=dot_precision, PDL=pdl, FRESH=fresh is not None, LENS_BLOCK=LENS_BLOCK,
                  INTERPRET=bool(triton.knobs.runtime.interpret), num_warps=num_warps, num_stages=num_stages,
                  enable_fp_fusion=fresh is None)  # (RoPE without FMA, as PyTorch)
    strides = (q_BHD.stride(0), q_BHD.stride(1), k_cache_SKD.stride(0), k_cache_SKD.stride(1), v_cache_SKD.stride(0),
               v_cache_SKD.stride(1), block_table_BP.stride(0), num_kv_splits, split_programs, MAX_BALANCED_SPLIT,
               scale * math.log2(math.e), *new)
    tensors = (q_BHD, k_cache_SKD, v_cache_SKD, block_table_BP, seq_lens_B, mid_o_BHND, mid_lse_BHN)
    if loop:
        _items_kernel[(programs, K)](*tensors, B, *strides, **common, **launch)
    else:
        _split_kernel[(B, K, num_kv_splits)](*tensors, *strides, **common, **launch)
    _merge_kernel[(B, H)](
        mid_o_BHND, mid_lse_BHN, o_BHD, seq_lens_B, o_BHD.stride(0), o_BHD.stride(1), num_kv_splits, split_programs,
        MAX_BALANCED_SPLIT, HEAD_DIM=D, BLOCK_D=head_block(D), BLOCK_SPLITS=triton.next_power_of_2(num_kv_splits),
        BLOCK_N=block_n, LENS_BLOCK=LENS_BLOCK, LOOP=loop, PDL=pdl, num_warps=4, **launch,
    )
    return o_BHD
