"""A matrix multiply for decode's few rows: y = x @ w.T with x [M, K] (M up to 64) and w [N, K], in Triton.

At decode batch sizes a projection reads a weight matrix of megabytes to multiply it by a handful of rows, so its
time is the time to stream the weight. cuBLAS tiles such a product into few, large output tiles: a 0.6B layer's
projections took about 5.5 us each on an H200 where their bytes need 1-3 us. Here each program owns a narrow
stripe of BLOCK_N output columns and, when the stripes alone are too few to keep every SM streaming, a share of the
K dimension (split-K): enough programs to read the matrix at full bandwidth.

Split-K without a second kernel and without atomics on the data: each program writes its fp32 partial sum to a
workspace, then takes a ticket from its stripe's counter (acquire-release); the program that draws the last
ticket adds the partials in split order, rounds once, stores the stripe, and resets the counter for the next
launch. The sum's order is fixed, so the result does not depend on which program finished last: the same inputs
give the same bits on every run. The counters live in one persistent zeroed buffer per device (every launch
leaves them zero again), allocated outside CUDA-graph capture on first use.

Rounding: products accumulate in fp32 and round once to the output dtype, as cuBLAS does; the two differ only in
the order of the fp32 sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tandem.kernels.fused import _interpreted, _round

MAX_ROWS = 64  # above this, cuBLAS's own tiles are the better choice
_COUNTERS = 1 << 16  # stripes a launch may have (N / BLOCK_N)
_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, INTERPRET: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        kk = k + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=(rows[:, None] < M) & (kk[None, :] < k_end),
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + kk[None, :], mask=(cols[:, None] < N) & (kk[None, :] < k_end),
                    other=0.0)
        if INTERPRET:  # the CPU interpreter's bf16 dot is wrong; bf16 products are exact in fp32 anyway
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))
    out = (rows[:, None] < M) & (cols[None, :] < N)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, _round(acc, y_ptr.dtype.element_ty, INTERPRET), mask=out)
    else:
        tile = rows[:, None] * N + cols[None, :]
        tl.store(part_ptr + pid_k * M * N + tile, acc, mask=out)
        tl.debug_barrier()  # every thread's share of the partial is written before one thread releases it
        ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")  # releases the partial, acquires the others'
        if ticket == SPLIT_K - 1:  # the last one in: every partial of this stripe is visible
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptr + s * M * N + tile, mask=out, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, _round(total, y_ptr.dtype.element_ty, INTERPRET), mask=out)
            tl.atomic_xchg(count_ptr + pid_n, 0)


def plan(M: int, N: int, K: int, num_sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K) for an [M, K] x [K, N] product: stripes of 32 columns (16 when the rows are
    many, to bound registers), split along K until about two programs per SM stream the matrix."""
    block_n = 32 if M <= 32 else 16
    stripes = triton.cdiv(N, block_n)
    block_k = 128
    split = 1
    while stripes * split < 2 * num_sms and K // (2 * split) >= 2 * block_k:
        split *= 2
    return block_n, block_k, split


def skinny_linear(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N] in x's dtype, for 1 <= M <= MAX_ROWS (x's last dim and w contiguous).
    `config`: (BLOCK_N, BLOCK_K, SPLIT_K) instead of `plan`'s (benchmarks sweep it)."""
    M, K = x.shape
    N = w.shape[0]
    if not 0 < M <= MAX_ROWS or w.shape[1] != K or x.stride(1) != 1 or not w.is_contiguous():
        raise ValueError(f"skinny_linear: wants x [M<={MAX_ROWS}, K] with unit column stride and w [N, K] contiguous, "
                         f"got x {tuple(x.shape)} strides {x.stride()} and w {tuple(w.shape)}")
    device = x.device
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    block_n, block_k, split = config or plan(M, N, K, num_sms)
    stripes = triton.cdiv(N, block_n)
    if stripes > _COUNTERS:
        raise ValueError(f"skinny_linear: {N} output columns need {stripes} stripes, more than {_COUNTERS}")
    if device not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_linear: first call inside CUDA-graph capture; run it once eagerly first")
        _counters[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    y = torch.empty(M, N, dtype=x.dtype, device=device)
    part = torch.empty(split if split > 1 else 0, M, N, dtype=torch.float32, device=device)
    k_per_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    _skinny_kernel[(stripes, split)](
        x, w, y, part, _counters[device], M, N, K, x.stride(0), w.stride(0), y.stride(0), k_per_split,
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        INTERPRET=_interpreted(), num_warps=4, num_stages=4)
    return y


def linear(x_TK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """x @ w.T: up to MAX_ROWS rows (decode) through `skinny_linear`, more (prefill) through cuBLAS."""
    return skinny_linear(x_TK, w_NK) if 0 < x_TK.shape[0] <= MAX_ROWS else F.linear(x_TK, w_NK)
