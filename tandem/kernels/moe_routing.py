"""The mixture-of-experts layer's routing on the GPU, each in one kernel launch: the router's top-k (`route_topk`)
and the grouping of (token, slot) pairs by expert (`group_pairs`).

`route_topk` has `tandem.model.moe.route`'s contract without a recorded routing: the fp32 softmax of each token's
router logits, its k largest probabilities (the lowest expert id first among equal ones), renormalised to sum to
one if asked, rounded to the logits' dtype. One program per block of tokens: softmax, k rounds of an arg-max and
the renormalisation in registers, where PyTorch runs half a dozen kernels.

`group_pairs` has `tandem.kernels.moe._tiles`' contract (pairs grouped by expert and cut into tiles of at most
`block_m` pairs of one expert, another rank's pairs last in no tile), in one program: a histogram of the pairs'
experts by atomic adds, its prefix sums, each pair's row by an atomic add on its expert's cursor, and the tiles
from the histogram, where a sort and its searches take a dozen kernels. Within an expert, pairs land in the order
the atomics ran: the rows of a tile are computed independently, so no result depends on it. `pair_tiles`: the
same contract for a few pairs, a tile each.

CUDA-graph safe: sizes come from the number of pairs and experts alone, and nothing is read on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.fused import varying


@triton.jit(**varying("T"))
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, T, E, stride_t, K: tl.constexpr, NORMALIZE: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    mask_t = tokens < T
    mask = mask_t[:, None] & (experts[None, :] < E)
    x = tl.load(logits_ptr + tokens.to(tl.int64)[:, None] * stride_t + experts[None, :], mask=mask,
                other=float("-inf")).to(tl.float32)
    x = tl.where(mask_t[:, None], x, 0.0)  # (rows past T: finite, never stored)
    p = tl.where(mask, tl.exp(x - tl.max(x, axis=1)[:, None]), 0.0)
    left = p / tl.sum(p, axis=1)[:, None]
    left = tl.where(mask, left, -1.0)  # a taken expert is set below every probability
    weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int64)
    for slot in tl.static_range(K):
        best = tl.max(left, axis=1)
        pick = tl.min(tl.where(left == best[:, None], experts[None, :], BLOCK_E), axis=1)
        left = tl.where(experts[None, :] == pick[:, None], -1.0, left)
        weights = tl.where(slots[None, :] == slot, best[:, None], weights)
        ids = tl.where(slots[None, :] == slot, pick[:, None].to(tl.int64), ids)
    if NORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    out = tokens.to(tl.int64)[:, None] * K + slots[None, :]
    keep = mask_t[:, None] & (slots[None, :] < K)
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + out, ids, mask=keep)


def route_topk(logits_TE: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k] int64): `route(logits_TE, k, normalize)`. The
    probabilities may differ from PyTorch's softmax in the last bits of fp32 (its exponential is not PyTorch's), so
    two experts whose probabilities are that close may swap places; equal logits pick the lowest id."""
    T, E = logits_TE.shape
    assert 0 < k <= E and logits_TE.stride(1) == 1, (logits_TE.shape, k, logits_TE.stride())
    weights = torch.empty(T, k, dtype=logits_TE.dtype, device=logits_TE.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits_TE.device)
    if T:
        block_e = triton.next_power_of_2(E)
        block_t = max(1, min(16, 4096 // block_e))
        _route_kernel[(triton.cdiv(T, block_t),)](logits_TE, weights, ids, T, E, logits_TE.stride(0), K=k,
                                                  NORMALIZE=normalize, BLOCK_T=block_t, BLOCK_E=block_e,
                                                  BLOCK_K=triton.next_power_of_2(k), num_warps=4)
    return weights, ids


@triton.jit(**varying("M", "num_tiles"))
def _group_kernel(ids_ptr, scratch_ptr, order_ptr, tiles_ptr, M, E, num_tiles, block_m,
                  BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TILES: tl.constexpr):
    """scratch: [2 * BLOCK_E] int32, the histogram, then each expert's cursor (the next free row of `order`)."""
    buckets = tl.arange(0, BLOCK_E)  # expert e < E; E: another rank's pairs
    tl.store(scratch_ptr + buckets, tl.zeros([BLOCK_E], tl.int32))
    tl.debug_barrier()
    for m0 in range(0, M, BLOCK):
        pairs = m0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < M, other=0)
        keys = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)
        tl.atomic_add(scratch_ptr + keys, 1, mask=pairs < M)
    tl.debug_barrier()
    counts = tl.load(scratch_ptr + buckets, cache_modifier=".cg")
    start = tl.cumsum(counts, axis=0) - counts  # the first row of each expert's pairs in `order`
    tl.store(scratch_ptr + BLOCK_E + buckets, start)
    tl.debug_barrier()
    for m0 in range(0, M, BLOCK):
        pairs = m0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < M, other=0)
        keys = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)
        rows = tl.atomic_add(scratch_ptr + BLOCK_E + keys, 1, mask=pairs < M)
        tl.store(order_ptr + rows, pairs, mask=pairs < M)
    # tiles: expert e takes cdiv(counts[e], block_m) of them, in expert order, written expert by expert: the j-th
    # of every expert at once
    num = tl.where(buckets < E, (counts + block_m - 1) // block_m, 0)
    first_tile = tl.cumsum(num, axis=0) - num
    for j in range(0, tl.max(num, axis=0)):
        mine = j < num
        first = start + j * block_m
        tiles = first_tile + j
        tl.store(tiles_ptr + tiles, buckets, mask=mine)
        tl.store(tiles_ptr + num_tiles + tiles, first, mask=mine)
        tl.store(tiles_ptr + 2 * num_tiles + tiles, tl.minimum(first + block_m, start + counts), mask=mine)
    for t0 in range(tl.sum(num, axis=0), num_tiles, BLOCK_TILES):  # the tiles past those in use: empty
        tiles = t0 + tl.arange(0, BLOCK_TILES)
        keep = tiles < num_tiles
        zeros = tl.zeros([BLOCK_TILES], tl.int32)
        tl.store(tiles_ptr + tiles, zeros + E - 1, mask=keep)
        tl.store(tiles_ptr + num_tiles + tiles, zeros, mask=keep)
        tl.store(tiles_ptr + 2 * num_tiles + tiles, zeros, mask=keep)


@triton.jit(**varying("M"))
def _pair_tiles_kernel(ids_ptr, order_ptr, tiles_ptr, M, E, BLOCK: tl.constexpr):
    pairs = tl.arange(0, BLOCK)
    mask = pairs < M
    ids = tl.load(ids_ptr + pairs, mask=mask, other=0)
    local = (ids >= 0) & (ids < E)
    tl.store(order_ptr + pairs, pairs, mask=mask)
    tl.store(tiles_ptr + pairs, tl.where(local, ids, E - 1).to(tl.int32), mask=mask)
    tl.store(tiles_ptr + M + pairs, pairs, mask=mask)
    tl.store(tiles_ptr + 2 * M + pairs, tl.where(local, pairs + 1, pairs), mask=mask)  # (another rank's: empty)


def pair_tiles(local_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tile per pair, in the pairs' order (order [M] int32 = 0..M-1, tiles [3, M] int32), in one launch: for
    so few pairs that grouping costs more than reading an expert once more when two pairs share it."""
    M, device = local_ids_TK.numel(), local_ids_TK.device
    order = torch.empty(M, dtype=torch.int32, device=device)
    tiles = torch.empty(3, M, dtype=torch.int32, device=device)
    if M:
        _pair_tiles_kernel[(1,)](local_ids_TK.reshape(-1).contiguous(), order, tiles, M, num_experts,
                                 BLOCK=triton.next_power_of_2(M), num_warps=1)
    return order, tiles


def group_pairs(local_ids_TK: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`tandem.kernels.moe._tiles`' (order [M] int32, tiles [3, N] int32), N = M // block_m + min(E, M), in one
    launch."""
    M, E, device = local_ids_TK.numel(), num_experts, local_ids_TK.device
    num_tiles = M // block_m + min(E, M)
    block_e = triton.next_power_of_2(E + 1)
    scratch = torch.empty(2 * block_e, dtype=torch.int32, device=device)
    order = torch.empty(M, dtype=torch.int32, device=device)
    tiles = torch.empty(3, num_tiles, dtype=torch.int32, device=device)
    _group_kernel[(1,)](local_ids_TK.reshape(-1).contiguous(), scratch, order, tiles, M, E, num_tiles, block_m,
                        BLOCK=1024, BLOCK_E=block_e, BLOCK_TILES=256, num_warps=8)
    return order, tiles
