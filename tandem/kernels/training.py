"""The trainer's fused elementwise ops on CUDA, with their backward passes: RMSNorm, RoPE and SiLU-and-multiply
as autograd Functions. In PyTorch each is a chain of small kernels forward and a longer one backward (an RMSNorm
is about seven forward and ten backward); a Qwen3-0.6B step on 3.7k tokens launched about 10k kernels, and those
chains took about half of its device time (`benchmarks/trainer_step.py --profile`). Their launches from Python
cost the host more than that, though, and the trainer is host-bound: `TrainerConfig.fused_kernels` is off by
default, and compiled layers (`TrainerConfig.compile`) fuse the same ops for less.

Forward passes are the inference kernels of `tandem.kernels.fused` (same rounding contract: fp32 math, rounded
to the activation dtype where the PyTorch model rounds). Backward kernels compute in fp32 from the saved inputs and
round once; PyTorch's autograd rounds some intermediate gradients to the activation dtype, so in bf16 the two
differ by a rounding or two, and in fp32 by an ulp. The gradient of a rounding is taken as 1, as autograd does.
Shapes: T rows (tokens, or tokens x heads), E the normalised dim, H heads, D head dim, I intermediate size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels import fused
from tandem.kernels.fused import _exp, _interpreted, _round, _row_warps

MAX_PROGRAMS = 512  # RMSNorm backward: programs, each summing its rows' weight gradient (then one sum over them)


# ------------------------------------------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rmsnorm_bwd_kernel(dy_ptr, x_ptr, w_ptr, dx_ptr, dw_ptr, T, E, eps, rows_per_program,
                        BLOCK_E: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows [pid * rows_per_program, ...) of x, dy, dx (contiguous [T, E]); this program's weight gradient goes
    to row pid of dw [programs, E] (fp32). y = w * round(x_hat), x_hat = x * rstd: with g = dy * w,
    dx = rstd * (g - x_hat * mean(g * x_hat)) and dw = sum over rows of dy * round(x_hat)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    dtype = x_ptr.dtype.element_ty
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_E], tl.float32)
    start = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = start + i
        valid = offs < tl.where(row < T, E, 0)  # (a row past T reads zeros: no dw)
        base = row * E
        x = tl.load(x_ptr + base + offs, mask=valid, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + base + offs, mask=valid, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / E + eps)
        x_hat = x * rstd
        dw += dy * _round(x_hat, dtype, INTERPRET).to(tl.float32)
        g = dy * w
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, 0) / E))
        tl.store(dx_ptr + base + offs, _round(dx, dtype, INTERPRET), mask=valid)
    tl.store(dw_ptr + pid.to(tl.int64) * E + offs, dw, mask=mask)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x_TE = x.reshape(-1, shape[-1])
        ctx.save_for_backward(x_TE, weight)
        ctx.eps = eps
        return fused.rmsnorm(x_TE, weight, eps).view(shape)

    @staticmethod
    def backward(ctx, dy):
        x_TE, weight = ctx.saved_tensors
        T, E = x_TE.shape
        x_TE, dy_TE = x_TE.contiguous(), dy.reshape(T, E).contiguous()
        dx_TE = torch.empty_like(x_TE)
        programs = max(1, min(T, MAX_PROGRAMS))
        dw_PE = torch.empty(programs, E, dtype=torch.float32, device=x_TE.device)
        if T == 0:
            dw_PE.zero_()
        else:
            block = triton.next_power_of_2(E)
            _rmsnorm_bwd_kernel[(programs,)](dy_TE, x_TE, weight, dx_TE, dw_PE, T, E, ctx.eps,
                                             triton.cdiv(T, programs), BLOCK_E=block, INTERPRET=_interpreted(),
                                             num_warps=_row_warps(block))
        return dx_TE.view(dy.shape), dw_PE.sum(0).to(weight.dtype), None


def rmsnorm(x: torch.Tensor, weight_E: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's `RMSNorm` over the last dim of x (any leading dims, last dim contiguous), differentiable."""
    return _RMSNorm.apply(x, weight_E, eps)


# ---------------------------------------------------------------------------------------------------------------- RoPE


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, num_heads, HALF: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr, INTERPRET: tl.constexpr):
    """Token t, heads [program_id(1) * BLOCK_H, ...): forward y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2 (halves of
    the head dim; the model's `x * cos + cat(-x2, x1) * sin`); backward (x = dy) the transposed rotation,
    dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1. cos, sin: fp32 [T, 2 * HALF]; out: contiguous [T, H, D].
    Each half is a block of BLOCK_HALF (a power of two) lanes, those past HALF masked."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask_d = offs < HALF
    mask = (heads < num_heads)[:, None] & mask_d[None, :]
    dtype = out_ptr.dtype.element_ty
    cos, sin = cos_ptr + t * 2 * HALF + offs, sin_ptr + t * 2 * HALF + offs
    c1, c2 = tl.load(cos, mask=mask_d, other=0.0), tl.load(cos + HALF, mask=mask_d, other=0.0)
    s1, s2 = tl.load(sin, mask=mask_d, other=0.0), tl.load(sin + HALF, mask=mask_d, other=0.0)
    x = x_ptr + t * stride_xt + heads[:, None] * stride_xh + offs[None, :]
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1, y2 = x1 * c1[None, :] + x2 * s2[None, :], x2 * c2[None, :] - x1 * s1[None, :]
    else:
        y1, y2 = x1 * c1[None, :] - x2 * s1[None, :], x2 * c2[None, :] + x1 * s2[None, :]
    out = out_ptr + t * num_heads * 2 * HALF + heads[:, None] * 2 * HALF + offs[None, :]
    tl.store(out, _round(y1, dtype, INTERPRET), mask=mask)
    tl.store(out + HALF, _round(y2, dtype, INTERPRET), mask=mask)


def _launch_rope(x_THD, cos_TD, sin_TD, backward: bool) -> torch.Tensor:
    T, H, D = x_THD.shape
    assert x_THD.stride(2) == 1 and D % 2 == 0, x_THD.shape
    out = torch.empty(T, H, D, dtype=x_THD.dtype, device=x_THD.device)
    if T == 0:
        return out
    block_half = triton.next_power_of_2(D // 2)
    block_h = min(triton.next_power_of_2(H), max(1, 1024 // block_half))
    _rope_kernel[(T, triton.cdiv(H, block_h))](
        x_THD, cos_TD, sin_TD, out, x_THD.stride(0), x_THD.stride(1), H, HALF=D // 2, BLOCK_HALF=block_half,
        BLOCK_H=block_h,
        BACKWARD=backward, INTERPRET=_interpreted(), num_warps=4, enable_fp_fusion=False)  # no FMA, as PyTorch
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        cos_TD, sin_TD = (c.reshape(c.shape[0], -1).float().contiguous() for c in (cos, sin))
        ctx.save_for_backward(cos_TD, sin_TD)
        return _launch_rope(x, cos_TD, sin_TD, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos_TD, sin_TD = ctx.saved_tensors
        return _launch_rope(dy, cos_TD, sin_TD, backward=True), None, None


def apply_rope(x_THD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The model's `apply_rope` (cos, sin as `rope_cos_sin` makes them: [T, 1, D], not differentiated), any even
    D; differentiable in x."""
    return _Rope.apply(x_THD, cos, sin)


# ------------------------------------------------------------------------------------------------------- SiLU * up


@triton.jit
def _silu_mul_bwd_kernel(dy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, inter_size,
                         BLOCK_I: tl.constexpr, INTERPRET: tl.constexpr):
    """y = round(silu(g)) * u: du = dy * round(silu(g)), dg = dy * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))).
    All [T, I] contiguous."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = offs < inter_size
    dtype = gate_ptr.dtype.element_ty
    base = row * inter_size
    dy = tl.load(dy_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + _exp(-g, INTERPRET))
    silu = _round(g * sig, dtype, INTERPRET).to(tl.float32)
    tl.store(dup_ptr + base + offs, _round(dy * silu, dtype, INTERPRET), mask=mask)
    tl.store(dgate_ptr + base + offs, _round(dy * u * sig * (1.0 + g * (1.0 - sig)), dtype, INTERPRET), mask=mask)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return fused.silu_mul(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = (t.contiguous() for t in ctx.saved_tensors)
        dy = dy.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        T, inter_size = gate.shape
        if T and inter_size:
            block = 1024
            _silu_mul_bwd_kernel[(T, triton.cdiv(inter_size, block))](dy, gate, up, dgate, dup, inter_size,
                                                                     BLOCK_I=block, INTERPRET=_interpreted(),
                                                                     num_warps=4)
        return dgate, dup


def silu_mul(gate_TI: torch.Tensor, up_TI: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` (2-D, last dim contiguous), differentiable in both."""
    return _SiluMul.apply(gate_TI, up_TI)
