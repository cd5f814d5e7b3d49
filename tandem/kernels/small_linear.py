"""Projections of steps with few rows (decode at small batch), with the work around them fused in.

At a handful of rows a projection reads megabytes of weights for a few kilobytes of activations, and a decode
step's time is set by how many kernels run one after another, not by their bytes (BENCHMARKS.md, engine
throughput). `small_linear` computes `y = x @ w.T` for up to `MAX_ROWS` rows and takes in what would otherwise be a
kernel of its own before or after it:

- `norm_weight`: x is first RMS-normalised (the model's `RMSNorm`, computed per row by every program from the whole
  row, so no normalised copy is written);
- `residual=True`: y is added into `out` in place (the residual stream's `x = x + sublayer(x)`);
- `silu=True`: w holds gate rows then up rows ([2I, E], as the fused path concatenates them) and the result is
  `silu(gate) * up` [T, I].

Rounding contract: as `tandem.kernels.fused` (whose helpers it uses): the normalised input, the projection's output,
silu, the product and the sum are each rounded to the activation dtype where the PyTorch model rounds them, so in
bf16 the results differ from the unfused kernels only where the order of a sum (the dot products, the sum of
squares) tips a rounding. Grids are fixed by shapes (CUDA-graph safe, no host syncs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.fused import _exp, _interpreted, _round

MAX_ROWS = 16  # the rows one program holds (tl.dot's smallest tile)


@triton.jit
def _small_linear_kernel(x_ptr, w_ptr, out_ptr, norm_w_ptr, T, N, E, stride_x, stride_w, stride_o, up_rows, eps,
                         NORM: tl.constexpr, RESIDUAL: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
                         INTERPRET: tl.constexpr):
    offs_t = tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    x_rows = x_ptr + offs_t[:, None] * stride_x
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    rstd = tl.zeros([BLOCK_T], tl.float32)
    if NORM:
        squares = tl.zeros([BLOCK_T], tl.float32)
        for k0 in range(0, E, BLOCK_K):
            kk = k0 + offs_k
            x = tl.load(x_rows + kk[None, :], mask=mask_t[:, None] & (kk < E)[None, :], other=0.0).to(tl.float32)
            squares += tl.sum(x * x, 1)
        rstd = tl.rsqrt(squares / E + eps)
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, E, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < E
        x = tl.load(x_rows + kk[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
        if NORM:
            norm_w = tl.load(norm_w_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)
            x = _round(_round(x.to(tl.float32) * rstd[:, None], dtype, INTERPRET).to(tl.float32) * norm_w[None, :],
                       dtype, INTERPRET)
        w_mask = mask_n[:, None] & mask_k[None, :]
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
        if DOT_FP32:  # fp32 weights, or the CPU interpreter (its bf16 dots are wrong): exact fp32 products
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
        if SILU:
            w_up = tl.load(w_rows + up_rows * stride_w + kk[None, :], mask=w_mask, other=0.0)
            if DOT_FP32:
                acc_up += tl.dot(x.to(tl.float32), tl.trans(w_up.to(tl.float32)), input_precision="ieee")
            else:
                acc_up += tl.dot(x, tl.trans(w_up))
    y = _round(acc, dtype, INTERPRET)
    if SILU:  # F.silu(gate) * up: x / (1 + exp(-x)), rounded, times up, rounded
        gate = y.to(tl.float32)
        silu = _round(tl.math.div_rn(gate, 1.0 + _exp(-gate, INTERPRET)), dtype, INTERPRET)
        y = _round(silu.to(tl.float32) * _round(acc_up, dtype, INTERPRET).to(tl.float32), dtype, INTERPRET)
    out = out_ptr + offs_t[:, None] * stride_o + offs_n[None, :]
    mask = mask_t[:, None] & mask_n[None, :]
    if RESIDUAL:
        y = _round(tl.load(out, mask=mask, other=0.0).to(tl.float32) + y.to(tl.float32), dtype, INTERPRET)
    tl.store(out, y, mask=mask)


def _blocks(N: int, E: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): narrow output tiles so that even a 1024-wide output spreads over 64 programs."""
    return (16 if N <= 2048 else 32), min(256, triton.next_power_of_2(E))


def small_linear(x_TE: torch.Tensor, w_NE: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                 out: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """`x @ w.T` for T <= MAX_ROWS rows (see the module docstring for what it fuses).

    x_TE: [T, E], last dim contiguous, any row stride; w_NE: [N, E] contiguous, x's dtype. norm_weight: [E], RMSNorm
    x first (with `eps`). out: a [T, N] tensor (last dim contiguous) the result is ADDED INTO in place and which is
    returned (the residual); else a new contiguous tensor is returned. silu: w is [2I, E], gate then up; returns
    `silu(gate) * up` [T, I] (not with `out`)."""
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
    block_n, block_k = _blocks(N, E)
    dot_fp32 = x_TE.dtype == torch.float32 or _interpreted()
    _small_linear_kernel[(triton.cdiv(N, block_n),)](
        x_TE, w_NE, y, x_TE if norm_weight is None else norm_weight, T, N, E, x_TE.stride(0), w_NE.stride(0),
        y.stride(0), N, eps, NORM=norm_weight is not None, RESIDUAL=out is not None, SILU=silu, BLOCK_T=MAX_ROWS,
        BLOCK_N=block_n, BLOCK_K=block_k, DOT_FP32=dot_fp32, INTERPRET=_interpreted(), num_warps=4, num_stages=3)
    return y
