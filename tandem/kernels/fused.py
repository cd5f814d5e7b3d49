"""Fused elementwise Triton kernels of the Qwen3 decoder layer: RMSNorm (alone or after the residual add), per-head
q/k RMSNorm followed by RoPE, and SiLU-and-multiply. In PyTorch each is a chain of small kernels (an RMSNorm is
about six, RoPE about eight per tensor); at decode batch sizes their launches, not their bytes, set the step time.

Rounding contract: every kernel computes in fp32 and rounds to the activation dtype exactly where the PyTorch model
(`tandem.model.qwen3`) rounds, so in bf16 the results differ from the model's only where a reduction order (the
sum of squares) tips a rounding, and in fp32 by that ulp. On the GPU, exp / cos / sin come from libdevice (the CUDA
math library PyTorch's kernels call, so bit-identical on a GPU), divisions use IEEE division (`div_rn`),
RoPE's inverse frequencies are PyTorch's own (`rope_inv_freq`) and RoPE compiles without FMA contraction, as
PyTorch evaluates `x * cos + rotated * sin`. Under the CPU interpreter numpy's math stands in (an ulp apart).

All wrappers launch a grid fixed by tensor shapes (CUDA-graph safe, no host syncs), accept 0 rows, fp32 or bf16
activations with the last dim contiguous, and expect weights of the activation dtype (the model's layout).
Shapes: T tokens, E hidden size, H query heads, K kv heads, D head dim, I intermediate size.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tandem.kernels.limits import MAX_HIDDEN

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: no programmatic dependent launches
    gdc_launch_dependents = gdc_wait = None


def _interpreted() -> bool:
    return bool(triton.knobs.runtime.interpret)


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` may be programmatic dependent launches (a kernel starts while the one before it
    finishes, and waits for it with `gdc_wait` before touching what that kernel wrote): Triton has them, the GPU is
    Hopper or later, not under the interpreter, and TANDEM_PDL is not 0.

    Every such kernel calls `gdc_launch_dependents` only after its own `gdc_wait`, so when a kernel starts, every
    kernel before the one just before it has finished: what those wrote (the step's inputs, earlier layers' and
    steps' KV) may be read before the wait (decode attention and the few-row projections do)."""
    return (gdc_wait is not None and os.environ.get("TANDEM_PDL", "1") != "0" and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9 and not _interpreted())


def varying(*names: str) -> dict:
    """`triton.jit` options for the arguments that change from launch to launch (counts, block-table widths,
    views' offsets): Triton compiles no variant per value that is 1, divisible by 16 or aligned, so a value first
    seen mid-run does not compile there, every request of the engine waiting (`benchmarks/jit_variants.py`).
    Only for arguments whose divisibility no vectorised access relies on."""
    params = inspect.signature(triton.jit).parameters
    return {key: list(names) for key in ("do_not_specialize", "do_not_specialize_on_alignment") if key in params}


def _row_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


# The CPU interpreter runs no extern (libdevice) calls, and its fp32 -> bf16 casts truncate where the GPU's round to
# nearest even: under INTERPRET these helpers use numpy's math and round the bits by hand.


@triton.jit
def _round(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 x rounded to nearest even in `dtype` (fp32 or bf16); NaN payloads aside, what the GPU's cast gives."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True).to(dtype)  # exact: the low 16 bits are zero
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _cos_sin(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        c, s = tl.cos(x), tl.sin(x)
    else:
        c, s = libdevice.cos(x), libdevice.sin(x)
    return c, s


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    return tl.exp(x) if INTERPRET else libdevice.exp(x)


# ------------------------------------------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rmsnorm_kernel(x_ptr, residual_ptr, weight_ptr, y_ptr, stride_x, stride_r, stride_y, E, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK_E: tl.constexpr, INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    dtype = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = _round(x.to(tl.float32) + r.to(tl.float32), dtype, INTERPRET)  # `x + residual`, rounded, then normed
        tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / E + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = _round(_round(x * rstd, dtype, INTERPRET).to(tl.float32) * w, dtype, INTERPRET)
    tl.store(y_ptr + row * stride_y + offs, y, mask=mask)


def _launch_rmsnorm(x_TE, residual_TE, weight_E, eps):
    T, E = x_TE.shape
    assert E <= MAX_HIDDEN and weight_E.shape == (E,) and weight_E.is_contiguous(), (x_TE.shape, weight_E.shape)
    assert x_TE.stride(1) == 1, "the hidden dim must be contiguous"
    y_TE = torch.empty(T, E, dtype=x_TE.dtype, device=x_TE.device)
    if T == 0:
        return y_TE
    r = x_TE if residual_TE is None else residual_TE
    block = triton.next_power_of_2(E)
    _rmsnorm_kernel[(T,)](x_TE, r, weight_E, y_TE, x_TE.stride(0), r.stride(0), y_TE.stride(0), E, eps,
                          HAS_RESIDUAL=residual_TE is not None, BLOCK_E=block, INTERPRET=_interpreted(),
                          num_warps=_row_warps(block))
    return y_TE


def rmsnorm(x_TE: torch.Tensor, weight_E: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(dtype)`: the model's `RMSNorm` over the last dim.
    Returns a new contiguous [T, E] tensor of x's dtype; x is read with any row stride."""
    return _launch_rmsnorm(x_TE, None, weight_E, eps)


def fused_add_rmsnorm(x_TE: torch.Tensor, residual_TE: torch.Tensor, weight_E: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual) in one pass over the row.

    The sum is rounded to the activation dtype (as the model's `x = x + sublayer(x)` is) and normalised from that
    rounded value. MUTATES `residual_TE`: the sum is written into it in place, and it is returned as the second
    element; y is a new contiguous tensor. x and residual must have the same shape and dtype."""
    assert x_TE.shape == residual_TE.shape and x_TE.dtype == residual_TE.dtype, (x_TE.shape, residual_TE.shape)
    assert residual_TE.stride(1) == 1
    return _launch_rmsnorm(x_TE, residual_TE, weight_E, eps), residual_TE


# ------------------------------------------------------------------------------------------------- q/k norm + RoPE


@triton.jit
def _norm_rope_heads(x_ptr, w_ptr, out_ptr, t, out_row, stride_xt, stride_xh, num_heads, cos, sin, eps,
                     HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr):
    """RMSNorm then rotate-half RoPE of token t's [num_heads, 2 * HALF] heads, into row `out_row` of out
    (contiguous [rows, heads, D]). Each half is a block of BLOCK_HALF (a power of two) lanes, those past HALF
    masked."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    mask = (offs_h < num_heads)[:, None] & mask_d[None, :]
    dtype = out_ptr.dtype.element_ty
    src = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    y1, y2 = norm_rope(x1, x2, w1, w2, cos, sin, eps, 2 * HALF, dtype, INTERPRET)
    dst = out_ptr + (out_row * num_heads + offs_h[:, None]) * (2 * HALF) + offs_d[None, :]
    tl.store(dst, y1, mask=mask)
    tl.store(dst + HALF, y2, mask=mask)


@triton.jit
def norm_rope(x1, x2, w1, w2, cos, sin, eps, D, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """RMSNorm (weight halves w1, w2) then rotate-half RoPE of heads given as their two halves in fp32 [rows, D / 2]
    (lanes past D / 2 zero); returns the rotated halves in `dtype`. The model rounds the normalised heads to the
    activation dtype; RoPE then runs in fp32 (cos / sin are fp32)."""
    rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]
    x1 = _round(_round(x1 * rstd, dtype, INTERPRET).to(tl.float32) * w1, dtype, INTERPRET).to(tl.float32)
    x2 = _round(_round(x2 * rstd, dtype, INTERPRET).to(tl.float32) * w2, dtype, INTERPRET).to(tl.float32)
    return _round(x1 * cos - x2 * sin, dtype, INTERPRET), _round(x2 * cos + x1 * sin, dtype, INTERPRET)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, q_w_ptr, k_w_ptr, pos_ptr, inv_freq_ptr, q_out_ptr, k_out_ptr,
                         v_ptr, v_out_ptr, slots_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                         stride_vh, H, K, eps, HEAD_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, TO_CACHE: tl.constexpr,
                         INTERPRET: tl.constexpr):
    """TO_CACHE: k and v go to row slots[t] of k_out and v_out (the KV cache), v unchanged; else k to row t.
    BLOCK_HALF: the next power of two of HEAD_DIM // 2."""
    t = tl.program_id(0).to(tl.int64)
    # rope_cos_sin's arithmetic: freq = float(position) * inv_freq, then cos / sin, all in fp32
    offs_f = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + offs_f, mask=offs_f < HEAD_DIM // 2, other=0.0)
    freq = tl.load(pos_ptr + t).to(tl.float32) * inv_freq
    cos, sin = _cos_sin(freq, INTERPRET)
    cos, sin = cos[None, :], sin[None, :]
    row = t
    if TO_CACHE:
        row = tl.load(slots_ptr + t).to(tl.int64)
    _norm_rope_heads(q_ptr, q_w_ptr, q_out_ptr, t, t, stride_qt, stride_qh, H, cos, sin, eps, HEAD_DIM // 2,
                     BLOCK_HALF, BLOCK_H, INTERPRET)
    _norm_rope_heads(k_ptr, k_w_ptr, k_out_ptr, t, row, stride_kt, stride_kh, K, cos, sin, eps, HEAD_DIM // 2,
                     BLOCK_HALF, BLOCK_K, INTERPRET)
    if TO_CACHE:
        offs_h, offs_d = tl.arange(0, BLOCK_K), tl.arange(0, 2 * BLOCK_HALF)
        mask = (offs_h < K)[:, None] & (offs_d < HEAD_DIM)[None, :]
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        tl.store(v_out_ptr + (row * K + offs_h[:, None]) * HEAD_DIM + offs_d[None, :], v, mask=mask)


@functools.cache
def rope_inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """[D / 2] fp32 `1 / theta ** (2i / D)`, by `rope_cos_sin`'s own PyTorch ops on the same device, so bit-identical
    to the model's (libdevice's powf, as Triton links it, differs from PyTorch's CUDA pow in 30-45% of entries).
    Built once per (D, theta, device), outside CUDA-graph capture: a graph would only fill it when replayed."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("qk_norm_rope: call it once before CUDA-graph capture (that also compiles the kernel)")
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)


def qk_norm_rope(q_THD: torch.Tensor, k_TKD: torch.Tensor, q_weight_D: torch.Tensor, k_weight_D: torch.Tensor,
                 positions_T: torch.Tensor, theta: float, eps: float,
                 kv_cache: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`apply_rope(q_norm(q), cos, sin), apply_rope(k_norm(k), cos, sin)` with `cos, sin = rope_cos_sin(positions)`,
    in one kernel (one program per token, all its q and k heads).

    q_THD, k_TKD: same dtype, any token/head strides (e.g. views of a fused qkv projection), last dim contiguous;
      any even D.
    positions_T: integer positions; cos/sin are computed from them in fp32 inside the kernel, from the inverse
      frequencies of `rope_inv_freq` (a cached [D / 2] table; the first call per (D, theta, device) must not be
      under CUDA-graph capture).
    kv_cache: optional (v_TKD, k_cache_SKD, v_cache_SKD, slots_T): the keys (normalised, rotated) and the values
      then go straight into the caches (contiguous, the activations' dtype) at rows `slots_T`, as the attention
      contexts' `index_copy_` would put them, and no k is returned: two kernels fewer per layer.
    Returns new contiguous (q [T, H, D], k [T, K, D] or None); the inputs are not modified."""
    T, H, D = q_THD.shape
    inv_freq_F = rope_inv_freq(D, theta, q_THD.device)
    assert k_TKD.shape[0] == T and k_TKD.shape[2] == D and k_TKD.dtype == q_THD.dtype, (q_THD.shape, k_TKD.shape)
    assert D % 2 == 0, f"head_dim {D}: must be even"
    assert q_THD.stride(2) == 1 and k_TKD.stride(2) == 1, "the head dim must be contiguous"
    assert q_weight_D.shape == (D,) and k_weight_D.shape == (D,) and q_weight_D.is_contiguous()
    assert k_weight_D.is_contiguous() and positions_T.shape == (T,) and not positions_T.is_floating_point()
    K = k_TKD.shape[1]
    q_out = torch.empty(T, H, D, dtype=q_THD.dtype, device=q_THD.device)
    if kv_cache is None:
        v_TKD, slots_T = q_THD, positions_T  # (neither read, nor v_out written)
        k_out = v_out = torch.empty(T, K, D, dtype=k_TKD.dtype, device=k_TKD.device)
    else:
        v_TKD, k_out, v_out, slots_T = kv_cache
        assert v_TKD.shape == k_TKD.shape and v_TKD.stride(2) == 1 and slots_T.shape == (T,), (v_TKD.shape, T)
        for cache in (k_out, v_out):
            assert cache.shape[1:] == (K, D) and cache.is_contiguous() and cache.dtype == k_TKD.dtype, cache.shape
    if T:
        block_h, block_k, block_half = (triton.next_power_of_2(n) for n in (H, K, D // 2))
        _qk_norm_rope_kernel[(T,)](
            q_THD, k_TKD, q_weight_D, k_weight_D, positions_T, inv_freq_F, q_out, k_out, v_TKD, v_out, slots_T,
            q_THD.stride(0), q_THD.stride(1), k_TKD.stride(0), k_TKD.stride(1), v_TKD.stride(0), v_TKD.stride(1),
            H, K, eps, HEAD_DIM=D, BLOCK_HALF=block_half, BLOCK_H=block_h, BLOCK_K=block_k,
            TO_CACHE=kv_cache is not None, INTERPRET=_interpreted(), num_warps=_row_warps(block_h * 2 * block_half),
            enable_fp_fusion=False,  # x * cos - x2 * sin without FMA, as PyTorch
        )
    return q_out, (k_out if kv_cache is None else None)


# ------------------------------------------------------------------------------------------------------- SiLU * up


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_g, stride_u, inter_size,
                     BLOCK_I: tl.constexpr, INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = offs < inter_size
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * inter_size + offs, silu_times(g, u, dtype, INTERPRET), mask=mask)


@triton.jit
def silu_times(gate, up, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """`F.silu(gate) * up` of fp32 values rounded from `dtype`: silu (x / (1 + exp(-x))) rounded, then the product
    rounded, as the model's two ops."""
    silu = _round(tl.math.div_rn(gate, 1.0 + _exp(-gate, INTERPRET)), dtype, INTERPRET)
    return _round(silu.to(tl.float32) * up, dtype, INTERPRET)


def silu_mul(gate_TI: torch.Tensor, up_TI: torch.Tensor, block_i: int = 1024) -> torch.Tensor:
    """`F.silu(gate) * up` (each rounded to the dtype, as the model's two ops are). gate and up: same shape and
    dtype, any row stride, last dim contiguous. Returns a new contiguous [T, I] tensor."""
    assert gate_TI.shape == up_TI.shape and gate_TI.dtype == up_TI.dtype, (gate_TI.shape, up_TI.shape)
    assert gate_TI.stride(1) == 1 and up_TI.stride(1) == 1, "the last dim must be contiguous"
    T, inter_size = gate_TI.shape
    out_TI = torch.empty(T, inter_size, dtype=gate_TI.dtype, device=gate_TI.device)
    if T == 0 or inter_size == 0:
        return out_TI
    grid = (T, triton.cdiv(inter_size, block_i))
    _silu_mul_kernel[grid](gate_TI, up_TI, out_TI, gate_TI.stride(0), up_TI.stride(0), inter_size,
                           BLOCK_I=block_i, INTERPRET=_interpreted(), num_warps=4)
    return out_TI


def silu_mul_merged(gate_up_T2I: torch.Tensor) -> torch.Tensor:
    """`silu_mul` of a merged gate/up projection's output: gate is the first half of the last dim, up the second."""
    inter_size = gate_up_T2I.shape[1] // 2
    return silu_mul(gate_up_T2I[:, :inter_size], gate_up_T2I[:, inter_size:])
