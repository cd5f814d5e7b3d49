"""The mixture-of-experts layer's experts on the GPU: a grouped SwiGLU MLP over each token's routed experts.

`fused_experts` has `Qwen3Experts.reference`'s contract. Three steps:
  - group: the (token, slot) pairs are grouped by expert without reading a value on the host (one kernel launch
    for decode's numbers of pairs, `tandem.kernels.moe_routing.group_pairs`; a sort of PyTorch's beyond) and cut
    into tiles of at most BLOCK_M pairs of one expert (`_tiles`); pairs of another rank's experts go last, into no
    tile.
  - gate/up kernel, one program per (tile, block of I): the tile's tokens times its expert's gate and up rows,
    SiLU-and-multiply in the epilogue, into an activation row per pair (in sorted order).
  - down kernel, one program per (tile, block of H): the activations times the expert's down matrix, scaled by
    the pair's routing weight in the epilogue, into a row per pair (in the pairs' own [T, k] order); a sum over
    the k slots then gives each token's output, in a fixed order (deterministic, no atomics).

CUDA-graph safe: every buffer and grid is sized from T * k and the number of local experts alone (tiles past the
ones in use are empty and exit at once), and the routing is read only on the device. A tile reads its expert's
weights once for up to BLOCK_M tokens, so a decode step reads each hit expert's weights about once.

Rounding: fp32 accumulation, rounded to the activation dtype where the reference rounds (the gate/up
projection, SiLU, the product, the down projection, the weighting); the k-slot sum rounds once, where the
reference's `index_add_` rounds after each expert. In fp32 the dots run in IEEE fp32 (no TF32).

Shapes: T tokens, k slots per token, M = T * k pairs, E local experts, H hidden size, I intermediate size,
N tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.fused import varying
from tandem.kernels.moe_routing import group_pairs, pair_tiles


def _interpreted() -> bool:
    return bool(triton.knobs.runtime.interpret)


@triton.jit
def _tile(tiles_ptr, num_tiles):
    """(expert, first row, end row) of this program's tile (see `_tiles`)."""
    tile = tl.program_id(0)
    expert = tl.load(tiles_ptr + tile).to(tl.int64)
    return expert, tl.load(tiles_ptr + num_tiles + tile), tl.load(tiles_ptr + 2 * num_tiles + tile)


@triton.jit(**varying("num_tiles"))
def _gate_up_kernel(x_ptr, w_ptr, order_ptr, tiles_ptr, act_ptr, num_tiles, top_k, H, inter_size,
                    stride_xt, stride_we, stride_wn, stride_wh,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """act[row, n] = silu(x[token] . gate[n]) * (x[token] . up[n]) for the tile's sorted rows and this program's
    block of I, where token = order[row] // top_k and gate, up are rows n and I + n of the expert's matrix."""
    expert, first, end = _tile(tiles_ptr, num_tiles)
    if first >= end:  # a tile past the ones in use
        return
    rows = first + tl.arange(0, BLOCK_M)
    mask_m = rows < end
    dtype = act_ptr.dtype.element_ty
    tokens = (tl.load(order_ptr + rows, mask=mask_m, other=0) // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter_size
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens[:, None] * stride_xt
    gate_cols = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn  # [K, N] blocks: the rows transposed
    up_cols = gate_cols + inter_size * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < H
        x = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(DOT_DTYPE)
        mask_kn = mask_k[:, None] & mask_n[None, :]
        gate = tl.load(gate_cols + kk[:, None] * stride_wh, mask=mask_kn, other=0.0).to(DOT_DTYPE)
        up = tl.load(up_cols + kk[:, None] * stride_wh, mask=mask_kn, other=0.0).to(DOT_DTYPE)
        acc_gate = tl.dot(x, gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(x, up, acc_up, input_precision=DOT_PRECISION)
    g = acc_gate.to(dtype).to(tl.float32)
    u = acc_up.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # F.silu, rounded as the reference's own op
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * inter_size + offs_n[None, :], (silu * u).to(dtype),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(**varying("num_tiles"))
def _down_kernel(act_ptr, w_ptr, order_ptr, tiles_ptr, weights_ptr, y_ptr, num_tiles, H, inter_size,
                 stride_we, stride_wh, stride_wi,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """y[pair, n] = weights[pair] * (act[row] . down[n]) for the tile's sorted rows and this program's block of
    H, where pair = order[row] (a flat index into [T, k])."""
    expert, first, end = _tile(tiles_ptr, num_tiles)
    if first >= end:  # a tile past the ones in use
        return
    rows = first + tl.arange(0, BLOCK_M)
    mask_m = rows < end
    dtype = y_ptr.dtype.element_ty
    pairs = tl.load(order_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    act_rows = act_ptr + rows.to(tl.int64)[:, None] * inter_size
    down_cols = w_ptr + expert * stride_we + offs_n[None, :] * stride_wh
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < inter_size
        a = tl.load(act_rows + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(DOT_DTYPE)
        w = tl.load(down_cols + kk[:, None] * stride_wi, mask=mask_k[:, None] & mask_n[None, :],
                    other=0.0).to(DOT_DTYPE)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    weight = tl.load(weights_ptr + pairs, mask=mask_m, other=0.0).to(tl.float32)
    y = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(y_ptr + pairs[:, None] * H + offs_n[None, :], y.to(dtype), mask=mask_m[:, None] & mask_n[None, :])


def _tiles(local_ids_TK: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs grouped by expert, on the device (no host sync; sizes from M and E only); up to
    `PAIR_TILES_UPTO` pairs, a tile per pair instead; up to `GROUP_IN_ONE_LAUNCH_UPTO`, in one launch.

    Returns (order [M]: flat pair indices t * k + slot sorted by expert, the other ranks' pairs last;
    tiles [3, N] int32: each tile's expert, first and end row of `order`). A tile holds at most `block_m` pairs
    of one expert; N = M // block_m + min(E, M) bounds the tiles in use (an expert with c pairs takes
    ceil(c / block_m) <= c // block_m + 1 tiles), and the tiles past those are empty (first row == end row)."""
    M, E, device = local_ids_TK.numel(), num_experts, local_ids_TK.device
    if M <= PAIR_TILES_UPTO:  # a tile per pair, in the pairs' order: no grouping at all
        return pair_tiles(local_ids_TK, E)
    if M <= GROUP_IN_ONE_LAUNCH_UPTO:
        return group_pairs(local_ids_TK, E, block_m)
    ids = local_ids_TK.reshape(-1)
    keys = torch.where((ids >= 0) & (ids < E), ids, E)  # E: another rank's expert
    sorted_keys, order = torch.sort(keys)  # (the order of one expert's pairs does not change any result)
    bounds = torch.searchsorted(sorted_keys, torch.arange(E + 1, device=device))
    num_expert_tiles = (bounds[1:] - bounds[:-1] + block_m - 1) // block_m
    tiles_end = torch.cumsum(num_expert_tiles, 0)
    tile = torch.arange(M // block_m + min(E, M), device=device)
    expert = torch.searchsorted(tiles_end, tile, right=True)  # E past the tiles in use
    in_use = expert < E
    e = expert.clamp(max=E - 1)
    first = bounds[e] + (tile - (tiles_end[e] - num_expert_tiles[e])) * block_m
    end = torch.minimum(first + block_m, bounds[e + 1])
    first = torch.where(in_use, first, 0)
    end = torch.where(in_use, end, 0)
    return order, torch.stack([e, first, end]).to(torch.int32)


# Up to this many pairs (decode at a batch of a few tokens) each pair is its own tile: the grouping's sort and
# searches cost more than reading an expert twice when two of so few pairs share it.
PAIR_TILES_UPTO = 32
# Up to this many pairs (decode and small mixed steps) the grouping is one launch of one program
# (`tandem.kernels.moe_routing.group_pairs`), whose loop grows with the pairs; beyond it, PyTorch's sort, whose
# kernels spread over the whole GPU.
GROUP_IN_ONE_LAUNCH_UPTO = 4096


def _blocks(num_pairs: int, num_experts: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) from host-known sizes: tiles as tall as the pairs an
    expert gets on average (16, `tl.dot`'s minimum, in decode), so few rows of a tile are padding."""
    if _interpreted():
        return 16, 32, 32, 4, 1  # the CPU interpreter: few, small programs
    per_expert = num_pairs / max(1, num_experts)
    if per_expert <= 16:
        return 16, 64, 128, 4, 3
    if per_expert <= 32:
        return 32, 64, 64, 4, 3
    return 64, 128, 64, 8, 3


def fused_experts(x_TH: torch.Tensor, gate_up_E2IH: torch.Tensor, down_EHI: torch.Tensor,
                  local_ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                  blocks: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Each token's sum over its k routed experts of weight * down(silu(gate(x)) * up(x)): `Qwen3Experts`'s
    kernel (its `reference`'s contract, for inference: no autograd).

    x_TH: activations (fp32, bf16 or fp16), hidden dim contiguous; T may be 0.
    gate_up_E2IH: this rank's experts' stacked gate (rows [:I]) and up (rows [I:]) matrices; down_EHI their down
      matrices; x's dtype, any strides.
    local_ids_TK: integer expert ids; ids in [0, E) are this rank's experts, any other id is another rank's and
      contributes nothing. weights_TK: routing weights, x's dtype.
    Returns a new contiguous [T, H] tensor of x's dtype (zeros for a token none of whose experts is here).
    Reads the routing only on the device, and allocates from T * k and E alone (CUDA-graph capturable).
    `blocks`: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) instead of `_blocks`' (to tune them)."""
    T, H = x_TH.shape
    E, two_inter, _ = gate_up_E2IH.shape
    inter, top_k = two_inter // 2, local_ids_TK.shape[1]
    assert gate_up_E2IH.shape == (E, 2 * inter, H) and down_EHI.shape == (E, H, inter), (gate_up_E2IH.shape,
                                                                                       down_EHI.shape, H)
    assert local_ids_TK.shape == weights_TK.shape == (T, top_k), (local_ids_TK.shape, weights_TK.shape)
    assert gate_up_E2IH.dtype == down_EHI.dtype == weights_TK.dtype == x_TH.dtype and x_TH.stride(1) == 1
    M = T * top_k
    y_MH = torch.zeros(M, H, dtype=x_TH.dtype, device=x_TH.device)  # another rank's pairs stay zero
    if M == 0:
        return y_MH.view(T, top_k, H).sum(dim=1)
    block_m, block_n, block_k, num_warps, num_stages = blocks or _blocks(M, E)
    order, tiles = _tiles(local_ids_TK, E, block_m)
    num_tiles = tiles.shape[1]
    act_MI = torch.empty(M, inter, dtype=x_TH.dtype, device=x_TH.device)  # rows in `order`'s order
    precision = "ieee" if x_TH.dtype == torch.float32 else "tf32"  # (only fp32 operands read it)
    # The CPU interpreter multiplies bf16 dot operands as raw integers: it gets them upcast (exactly).
    dot_dtype = tl.float32 if _interpreted() else {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
                                                   torch.float16: tl.float16}[x_TH.dtype]
    _gate_up_kernel[(num_tiles, triton.cdiv(inter, block_n))](
        x_TH, gate_up_E2IH, order, tiles, act_MI, num_tiles, top_k, H, inter,
        x_TH.stride(0), *gate_up_E2IH.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages)
    _down_kernel[(num_tiles, triton.cdiv(H, block_n))](
        act_MI, down_EHI, order, tiles, weights_TK.reshape(-1), y_MH, num_tiles, H, inter,
        *down_EHI.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages)
    return y_MH.view(T, top_k, H).sum(dim=1)
