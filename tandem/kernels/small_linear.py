"""Projections of steps with few rows (decode at small batch), with the work around them fused in.

At a handful of rows a projection reads megabytes of weights for a few kilobytes of activations, and a decode
step's time is set by how many kernels run one after another, not by their bytes (BENCHMARKS.md, engine
throughput). `small_linear` computes `y = x @ w.T` for up to `MAX_ROWS` rows and takes in what would otherwise be a
kernel of its own before or after it:

- `norm_weight`: x is first RMS-normalised (the model's `RMSNorm`, computed per row by every program from the whole
  row, so no normalised copy is written);
- `out`: y is added into it in place (the residual stream's `x = x + sublayer(x)`);
- `silu=True`: w holds gate rows then up rows ([2I, E], as the fused path concatenates them) and the result is
  `silu(gate) * up` [T, I].

Up to `VECTOR_ROWS` rows the products are summed on the CUDA cores over a tile of the rows there are
(`vector_blocks`), above it in tensor-core tiles of 16 rows. Up to `ROWWISE_ROWS` rows a vector tile's products
are summed a row at a time, in the layout the weight tile is loaded in: summed as one [rows, columns, inputs]
product, the compiler moves the whole tile through shared memory into that product's layout first.

Rounding contract: as `tandem.kernels.fused` (whose helpers it uses): the normalised input, the projection's output,
silu, the product and the sum are each rounded to the activation dtype where the PyTorch model rounds them, so in
bf16 the results differ from the unfused kernels only where the order of a sum (the dot products, the sum of
squares) tips a rounding. Grids are fixed by shapes (CUDA-graph safe, no host syncs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.kernels.fused import (
    _cos_sin,
    _interpreted,
    _round,
    gdc_launch_dependents,
    gdc_wait,
    norm_rope,
    pdl_supported,
    rope_inv_freq,
    silu_times,
)

MAX_ROWS = 16  # the rows one program holds (tl.dot's smallest tile)
MAX_COLUMN_BLOCKS = 4096  # of a split projection's output (`arrival_counts`)
VECTOR_ROWS = 2  # up to these rows by default, `vector_blocks` (their products on the CUDA cores)
FRESH_ROWS = 2  # up to these rows a decode step's q/k norm and RoPE run in attention (`Qwen3ForCausalLM`, `Fresh`)
VECTOR_TILE_BYTES = 16384  # of weights a vector tile's program holds (`vector_blocks`)
VECTOR_WARPS = 4  # of a vector tile's program
ROWWISE_ROWS = 2  # up to these rows a vector tile's products are summed a row at a time (`_dot`; not with heads)
EARLY_RESIDUAL = True  # the residual read before the dependent wait (`small_linear`'s `out`; an A/B switch)


@triton.jit
def _dot(acc, x, w, DOT_FP32: tl.constexpr, VECTOR: tl.constexpr, ROWWISE: tl.constexpr):
    if ROWWISE:  # (up to `ROWWISE_ROWS` rows) a row at a time: each product in the weight tile's loaded layout
        rows = tl.arange(0, x.shape[0])[:, None]
        for t in tl.static_range(x.shape[0]):
            x_t = tl.sum(tl.where(rows == t, x.to(tl.float32), 0.0), 0)
            acc += tl.where(rows == t, tl.sum(x_t[None, :] * w.to(tl.float32), 1)[None, :], 0.0)
    elif VECTOR:  # a row or a few: products summed on the CUDA cores, no tensor-core tile padded to 16 rows
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
    elif DOT_FP32:  # fp32 weights, or the CPU interpreter (its bf16 dots are wrong): exact fp32 products
        acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        acc += tl.dot(x, tl.trans(w))
    return acc


@triton.jit
def _input(x_rows, norm_w_ptr, kk, mask_t, E, rstd, NORM: tl.constexpr, dtype: tl.constexpr,
           INTERPRET: tl.constexpr):
    """Columns kk of the input rows, normalised (the model's RMSNorm, rounded where it rounds) if NORM."""
    mask_k = kk < E
    x = tl.load(x_rows + kk[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
    if NORM:
        norm_w = tl.load(norm_w_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)
        x = _round(_round(x.to(tl.float32) * rstd[:, None], dtype, INTERPRET).to(tl.float32) * norm_w[None, :],
                   dtype, INTERPRET)
    return x


@triton.jit
def _epilogue(acc, acc_up, residual, out_ptr, offs_t, offs_n, mask_t, mask_n, stride_o, RESIDUAL: tl.constexpr,
              SILU: tl.constexpr, EARLY: tl.constexpr, INTERPRET: tl.constexpr):
    """Store the tile (rounded; SILU: silu(gate) * up); RESIDUAL: added to what `out` holds, which is `residual`
    if EARLY (read before the dependent wait), else read here."""
    dtype = out_ptr.dtype.element_ty
    y = _round(acc, dtype, INTERPRET)
    if SILU:
        y = silu_times(y.to(tl.float32), _round(acc_up, dtype, INTERPRET).to(tl.float32), dtype, INTERPRET)
    out = out_ptr + offs_t[:, None] * stride_o + offs_n[None, :]
    mask = mask_t[:, None] & mask_n[None, :]
    if RESIDUAL:
        if not EARLY:
            residual = tl.load(out, mask=mask, other=0.0)
        y = _round(residual.to(tl.float32) + y.to(tl.float32), dtype, INTERPRET)
    tl.store(out, y, mask=mask)


@triton.jit
def _heads_epilogue(acc, acc_hi, pid_n, offs_t, mask_t, q_norm_ptr, k_norm_ptr, pos_ptr, inv_freq_ptr, q_out_ptr,
                    k_cache_ptr, v_cache_ptr, slots_ptr, H, K, eps, D: tl.constexpr, INTERPRET: tl.constexpr):
    """Head pid_n of a fused q/k/v projection (acc: its first D / 2 columns, acc_hi the rest): q/k RMSNorm then
    RoPE for a query or key head (as `fused.qk_norm_rope`), a query into q_out [T, H, D], a key or value into its
    cache at the row's slot."""
    dtype = q_out_ptr.dtype.element_ty
    offs_d = tl.arange(0, D // 2)
    x1, x2 = _round(acc, dtype, INTERPRET), _round(acc_hi, dtype, INTERPRET)
    slots = tl.load(slots_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    mask = mask_t[:, None]
    if pid_n >= H + K:  # a value head: as it is
        dst = v_cache_ptr + (slots[:, None] * K + pid_n - H - K) * D + offs_d[None, :]
        tl.store(dst, x1, mask=mask)
        tl.store(dst + D // 2, x2, mask=mask)
    else:
        is_q = pid_n < H
        w1 = tl.where(is_q, tl.load(q_norm_ptr + offs_d), tl.load(k_norm_ptr + offs_d)).to(tl.float32)[None, :]
        w2 = tl.where(is_q, tl.load(q_norm_ptr + D // 2 + offs_d),
                      tl.load(k_norm_ptr + D // 2 + offs_d)).to(tl.float32)[None, :]
        freq = tl.load(pos_ptr + offs_t, mask=mask_t, other=0).to(tl.float32)[:, None] * tl.load(
            inv_freq_ptr + offs_d)[None, :]
        cos, sin = _cos_sin(freq, INTERPRET)
        y1, y2 = norm_rope(x1.to(tl.float32), x2.to(tl.float32), w1, w2, cos, sin, eps, D, dtype, INTERPRET)
        q_dst = q_out_ptr + (offs_t[:, None] * H + pid_n) * D + offs_d[None, :]
        k_dst = k_cache_ptr + (slots[:, None] * K + pid_n - H) * D + offs_d[None, :]
        dst = tl.where(is_q, q_dst, k_dst)
        tl.store(dst, y1, mask=mask)
        tl.store(dst + D // 2, y2, mask=mask)


@triton.jit
def _small_linear_kernel(x_ptr, w_ptr, out_ptr, norm_w_ptr, partial_ptr, arrived_ptr, q_norm_ptr, k_norm_ptr, pos_ptr,
                         inv_freq_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, T, N, E, stride_x,
                         stride_w, stride_o, up_rows, k_split, H, K, eps, NORM: tl.constexpr,
                         RESIDUAL: tl.constexpr, SILU: tl.constexpr, HEADS: tl.constexpr, SPLITS: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
                         DOT_FP32: tl.constexpr, VECTOR: tl.constexpr, ROWWISE: tl.constexpr, PDL: tl.constexpr,
                         EARLY_RESIDUAL: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (n, s) computes output columns n * BLOCK_N... over input columns [s * k_split, (s + 1) * k_split).
    SPLITS > 1: each stores its fp32 partial sums [BLOCK_T, BLOCK_N] (and the up projection's) in partial_ptr
    [SPLITS, 2, BLOCK_T, N] and counts itself in arrived_ptr[n]; the last of a column block to arrive adds the
    partials in split order (the result does not depend on which is last), resets the count to zero for the next
    launch, and writes the output. SILU: a second tile `up_rows` rows below the first (the up projection's);
    HEADS: program n's columns are head n's, its first half in the first tile and the second in the second
    (`_heads_epilogue`; BLOCK_N is half a head, up_rows too). PDL: launched as a programmatic dependent of the
    kernel before it, a program loads its first weight tile (never written by a step) while that kernel
    finishes, and waits for it (`gdc_wait`) before reading anything else or writing anything; but for
    EARLY_RESIDUAL (with RESIDUAL), which reads its tile of out_ptr before the wait as well."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    offs_t = tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    PAIRED: tl.constexpr = SILU or HEADS  # two accumulators
    offs_n = pid_n * (2 * BLOCK_N if HEADS else BLOCK_N) + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_start = pid_s * k_split
    k_end = tl.minimum(E, k_start + k_split)
    kk = k_start + tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    x_rows = x_ptr + offs_t[:, None] * stride_x
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    up_rows_ptr = w_rows + up_rows * stride_w
    w_mask = mask_n[:, None] & (kk < k_end)[None, :]
    w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
    w_up = w
    if PAIRED:
        w_up = tl.load(up_rows_ptr + kk[None, :], mask=w_mask, other=0.0)
    residual = tl.zeros([BLOCK_T, BLOCK_N], out_ptr.dtype.element_ty)
    if RESIDUAL and EARLY_RESIDUAL:  # (the step's residual, written two kernels before at the latest)
        residual = tl.load(out_ptr + offs_t[:, None] * stride_o + offs_n[None, :],
                           mask=mask_t[:, None] & mask_n[None, :], other=0.0)
    if PDL:
        gdc_wait()
    rstd = tl.zeros([BLOCK_T], tl.float32)
    if NORM:  # over the whole row, whatever this program's share of it
        squares = tl.zeros([BLOCK_T], tl.float32)
        for k0 in range(0, E, NORM_BLOCK):
            cols = k0 + tl.arange(0, NORM_BLOCK)
            x = tl.load(x_rows + cols[None, :], mask=mask_t[:, None] & (cols < E)[None, :], other=0.0)
            squares += tl.sum(x.to(tl.float32) * x.to(tl.float32), 1)
        rstd = tl.rsqrt(squares / E + eps)
    x = _input(x_rows, norm_w_ptr, kk, mask_t, k_end, rstd, NORM, dtype, INTERPRET)
    acc = _dot(tl.zeros([BLOCK_T, BLOCK_N], tl.float32), x, w, DOT_FP32, VECTOR, ROWWISE)
    acc_up = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    if PAIRED:
        acc_up = _dot(acc_up, x, w_up, DOT_FP32, VECTOR, ROWWISE)
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = _input(x_rows, norm_w_ptr, kk, mask_t, k_end, rstd, NORM, dtype, INTERPRET)
        w_mask = mask_n[:, None] & (kk < k_end)[None, :]
        acc = _dot(acc, x, tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0), DOT_FP32, VECTOR, ROWWISE)
        if PAIRED:
            acc_up = _dot(acc_up, x, tl.load(up_rows_ptr + kk[None, :], mask=w_mask, other=0.0), DOT_FP32,
                          VECTOR, ROWWISE)
    if PDL:
        gdc_launch_dependents()
    write = True  # this program writes the output: always unsplit, else the last of its column block to arrive
    if SPLITS > 1:
        tile = offs_t[:, None] * N + offs_n[None, :]
        tl.store(partial_ptr + pid_s * 2 * BLOCK_T * N + tile, acc, mask=mask_n[None, :])
        if PAIRED:
            tl.store(partial_ptr + (pid_s * 2 + 1) * BLOCK_T * N + tile, acc_up, mask=mask_n[None, :])
        tl.debug_barrier()  # every thread's partials stored before the count says so
        write = tl.atomic_add(arrived_ptr + pid_n, 1, sem="acq_rel") == SPLITS - 1
        if write:
            acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLITS):
                acc += tl.load(partial_ptr + s * 2 * BLOCK_T * N + tile, mask=mask_n[None, :], other=0.0,
                               cache_modifier=".cg")
                if PAIRED:
                    acc_up += tl.load(partial_ptr + (s * 2 + 1) * BLOCK_T * N + tile, mask=mask_n[None, :],
                                      other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(arrived_ptr + pid_n, 0)
    if write:
        if HEADS:
            _heads_epilogue(acc, acc_up, pid_n, offs_t, mask_t, q_norm_ptr, k_norm_ptr, pos_ptr, inv_freq_ptr,
                            out_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, H, K, eps, 2 * BLOCK_N, INTERPRET)
        else:
            _epilogue(acc, acc_up, residual, out_ptr, offs_t, offs_n, mask_t, mask_n, stride_o, RESIDUAL, SILU,
                      EARLY_RESIDUAL, INTERPRET)


@dataclass(frozen=True)
class Blocks:
    """A launch's tiling: output columns and input columns per tile, warps, pipeline stages, whether it is a
    programmatic dependent launch (PDL: Hopper and later; never under the CPU interpreter), how many programs
    split the input columns, and whether the products are summed on the CUDA cores (`vector`: a tile of the rows
    there are, not of tl.dot's 16)."""

    n: int
    k: int
    warps: int = 4
    stages: int = 3
    pdl: bool = False
    splits: int = 1
    vector: bool = False


def default_blocks(N: int, E: int, device: torch.device, split: bool = True, heads: int | None = None,
                   itemsize: int = 2, rows: int = MAX_ROWS, paired: bool = False) -> Blocks:
    """Up to `VECTOR_ROWS` rows (one with `heads`), vector tiles (`vector_blocks`). Else narrow output tiles, so
    that even a 1024-wide output spreads over 64 programs (`heads`: a program per head); with `split`, the input
    columns split so that about two programs run per multiprocessor. A tile holds 512 bytes of a weight row (256
    columns of bf16, 128 of fp32: the pipeline's stages fit in shared memory)."""
    if rows <= (min(1, VECTOR_ROWS) if heads else VECTOR_ROWS):  # (a head's split vector tiles: one row at most)
        return vector_blocks(N, E, device, split, heads, itemsize, paired=paired)
    pdl = pdl_supported(device)
    n, k = 16 if N <= 2048 else 32, min(512 // itemsize, triton.next_power_of_2(E))
    blocks = heads or triton.cdiv(N, n)
    splits = max(1, min(8, 2 * _multiprocessors(device) // blocks, triton.cdiv(E, k))) if split else 1
    return Blocks(n, k, pdl=pdl, splits=splits)


def vector_blocks(N: int, E: int, device: torch.device, split: bool = True, heads: int | None = None,
                  itemsize: int = 2, tile_bytes: int = VECTOR_TILE_BYTES, paired: bool = False) -> Blocks:
    """Tiles of about `tile_bytes` of weights a program (`paired`: two tiles, as SiLU's gate and up; `heads`:
    always two, a head's halves), a program's whole share of the input columns in one tile: every program's
    weights are asked for at once, before it waits for the kernel before it (PDL), and with no shared memory (one
    stage) the programs of the next kernel fit beside it. A program holds whole output rows, as few as make the
    tile, unless `heads` (a head a program), where the input columns are split instead (with `split`; a split is
    at least 16 columns)."""
    pdl = pdl_supported(device)
    row_bytes = triton.next_power_of_2(E) * itemsize
    if heads is None:
        n = max(1, min(triton.next_power_of_2(N), tile_bytes // row_bytes // (2 if paired else 1)))
        n = 1 << (n.bit_length() - 1)  # a power of two
        return Blocks(n, triton.next_power_of_2(E), VECTOR_WARPS, stages=1, pdl=pdl, vector=True)
    head_rows = N // heads // 2  # a tile is half a head's rows (its pair, the other half)
    splits = max(1, min(E // 16, 2 * row_bytes * head_rows // tile_bytes)) if split else 1
    return Blocks(head_rows, triton.next_power_of_2(triton.cdiv(E, splits)), VECTOR_WARPS, stages=1, pdl=pdl,
                  splits=splits, vector=True)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def arrival_counts(device: torch.device | str) -> torch.Tensor:
    """The zeroed counts a split projection needs (`small_linear(arrived=...)`), for one stream of launches:
    kernels that may run at the same time need counts of their own. Create it outside CUDA-graph capture."""
    return torch.zeros(MAX_COLUMN_BLOCKS, dtype=torch.int32, device=device)


def small_linear(x_TE: torch.Tensor, w_NE: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                 out: torch.Tensor | None = None, silu: bool = False, blocks: Blocks | None = None,
                 arrived: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w.T` for T <= MAX_ROWS rows (see the module docstring for what it fuses).

    x_TE: [T, E], last dim contiguous, any row stride; w_NE: [N, E] contiguous, x's dtype. norm_weight: [E], RMSNorm
    x first (with `eps`). out: a [T, N] tensor (last dim contiguous) the result is ADDED INTO in place and which is
    returned (the residual; a programmatic dependent launch reads it before it waits for the kernel launched just
    before it, which must not write it); else a new contiguous tensor is returned. silu: w is [2I, E], gate then
    up; returns `silu(gate) * up` [T, I] (not with `out`). blocks: the tiling (`default_blocks` when None). arrived: the
    counts of `arrival_counts`, which splitting the input columns over programs needs (without, no split); the
    kernel leaves them zero."""
    T, E = x_TE.shape
    assert T <= MAX_ROWS, f"small_linear: at most {MAX_ROWS} rows, got {T}"
    assert w_NE.shape[1] == E and w_NE.is_contiguous() and w_NE.dtype == x_TE.dtype, (x_TE.shape, w_NE.shape)
    assert x_TE.stride(1) == 1, "the last dim must be contiguous"
    assert not (silu and out is not None), "silu and a residual: not one projection's job"
    N = w_NE.shape[0] // 2 if silu else w_NE.shape[0]
    assert not silu or w_NE.shape[0] == 2 * N, f"silu: w must have an even number of rows, got {w_NE.shape[0]}"
    if norm_weight is not None:
        assert norm_weight.shape == (E,) and norm_weight.is_contiguous(), norm_weight.shape
    if out is None:
        y = torch.empty(T, N, dtype=x_TE.dtype, device=x_TE.device)
    else:
        assert out.shape == (T, N) and out.dtype == x_TE.dtype and out.stride(1) == 1, (out.shape, T, N)
        y = out
    if T == 0:
        return y
    b = blocks or default_blocks(N, E, x_TE.device, split=arrived is not None, itemsize=x_TE.itemsize, rows=T,
                                 paired=silu)
    _launch(x_TE, w_NE, y, norm_weight, eps, b, arrived, N, triton.cdiv(N, b.n), b.n, RESIDUAL=out is not None,
            SILU=silu, HEADS=False)
    return y


def takes_heads(head_dim: int) -> bool:
    """Whether `small_qkv` takes this head dim: a program holds a head as two halves of a power of two lanes
    each, at least tl.dot's 16."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 16 and half & (half - 1) == 0


def small_qkv(x_TE: torch.Tensor, w_qkv: torch.Tensor, norm_weight: torch.Tensor, eps: float, q_norm: torch.Tensor,
              k_norm: torch.Tensor, positions_T: torch.Tensor, theta: float, num_heads: int,
              kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor], arrived: torch.Tensor | None = None,
              blocks: Blocks | None = None) -> torch.Tensor:
    """A decoder layer's attention inputs in one kernel: `rmsnorm(x) @ w_qkv.T` split into query, key and value
    heads, q/k RMSNorm then RoPE on queries and keys (`fused.qk_norm_rope`'s arithmetic), keys and values written
    into `kv_cache` = (k_cache_SKD, v_cache_SKD, slots_T) at each row's slot. Returns the queries [T, H, D].

    w_qkv: [(H + 2K) * D, E], queries then keys then values (the fused path's concatenation); q_norm, k_norm: [D];
    the caches contiguous, of x's dtype. `rope_inv_freq`'s first call per (D, theta, device) must come before any
    CUDA-graph capture. Other arguments as `small_linear`'s (blocks.n is ignored: a program holds a head)."""
    T, E = x_TE.shape
    k_cache, v_cache, slots_T = kv_cache
    K, D = k_cache.shape[1], k_cache.shape[2]
    N = w_qkv.shape[0]
    assert T <= MAX_ROWS and (num_heads + 2 * K) * D == N and takes_heads(D), (T, N, num_heads, K, D)
    assert w_qkv.shape[1] == E and w_qkv.is_contiguous() and w_qkv.dtype == x_TE.dtype and x_TE.stride(1) == 1
    for cache in (k_cache, v_cache):
        assert cache.is_contiguous() and cache.dtype == x_TE.dtype and cache.shape[1:] == (K, D), cache.shape
    assert slots_T.shape == (T,) and positions_T.shape == (T,) and not positions_T.is_floating_point()
    q = torch.empty(T, num_heads, D, dtype=x_TE.dtype, device=x_TE.device)
    if T == 0:
        return q
    b = blocks or default_blocks(N, E, x_TE.device, split=arrived is not None, heads=N // D, itemsize=x_TE.itemsize,
                                 rows=T)
    inv_freq = rope_inv_freq(D, theta, x_TE.device)
    _launch(x_TE, w_qkv, q, norm_weight, eps, b, arrived, N, N // D, D // 2, RESIDUAL=False, SILU=False,
            HEADS=True, heads=(q_norm, k_norm, positions_T, inv_freq, k_cache, v_cache, slots_T, num_heads, K))
    return q


def _launch(x_TE, w_NE, y, norm_weight, eps, b: Blocks, arrived, N, column_blocks, block_n, RESIDUAL, SILU, HEADS,
            heads=None) -> None:
    T, E = x_TE.shape
    k_split = triton.cdiv(triton.cdiv(E, b.splits), b.k) * b.k  # a whole number of tiles each
    splits = triton.cdiv(E, k_split)
    partial = x_TE  # (not read without splits)
    if splits > 1:
        assert arrived is not None and arrived.dtype == torch.int32 and arrived.numel() >= column_blocks, (
            "small_linear: splitting the input columns needs `arrived` (arrival_counts)")
        partial = torch.empty(splits, 2, MAX_ROWS, N, dtype=torch.float32, device=x_TE.device)
    q_norm, k_norm, positions, inv_freq, k_cache, v_cache, slots, H, K = heads or (x_TE,) * 7 + (0, 0)
    pdl = {"launch_pdl": True} if b.pdl else {}
    block_t = triton.next_power_of_2(T) if b.vector else MAX_ROWS
    _small_linear_kernel[(column_blocks, splits)](
        x_TE, w_NE, y, x_TE if norm_weight is None else norm_weight, partial, arrived if splits > 1 else x_TE,
        q_norm, k_norm, positions, inv_freq, k_cache, v_cache, slots, T, N, E, x_TE.stride(0), w_NE.stride(0),
        y.stride(0) if not HEADS else 0, block_n if HEADS else N, k_split, H, K, eps, NORM=norm_weight is not None,
        RESIDUAL=RESIDUAL, SILU=SILU, HEADS=HEADS, SPLITS=splits, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=b.k,
        NORM_BLOCK=max(b.k, min(triton.next_power_of_2(E), 4096 // block_t)), VECTOR=b.vector,
        ROWWISE=b.vector and not HEADS and block_t <= ROWWISE_ROWS,
        DOT_FP32=x_TE.dtype == torch.float32 or _interpreted(), PDL=b.pdl, EARLY_RESIDUAL=EARLY_RESIDUAL,
        INTERPRET=_interpreted(),
        num_warps=b.warps, num_stages=min(b.stages, k_split // b.k), enable_fp_fusion=not HEADS, **pdl)
    # (no more stages than a program has tiles: its loop runs one time fewer, and a stage it cannot fill would only
    # hold shared memory; no FMA fusion with heads: RoPE rounds as PyTorch's)
