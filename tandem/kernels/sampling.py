"""Gumbel-max sampling with exact logprobs for rows without top-k / top-p / min-p, fused into one pass over the
logits: the same tokens as the PyTorch path of `tandem.engine.sampler.sample`, without materialising the [B, V]
int64 hash, uniforms, Gumbel noise or log-softmax.

Each element's uniform is `hash_uniform`'s integer hash recomputed on the fly in uint32 arithmetic (its int64 form
only ever keeps the low 32 bits), so the noise is bit-identical. On the GPU the elementwise chain the argmax sees
(IEEE division by the temperature, libdevice's logf for the Gumbel noise, one fp32 add) is the one PyTorch's CUDA
kernels evaluate, so the tokens equal PyTorch's exactly (tests/test_fused_kernels.py checks it on a GPU); under
the CPU interpreter numpy's log stands in for libdevice and may differ by an ulp. The logprob,
log_softmax(logits / T)[token], comes from an online max / sum-exp over the same pass, equal to PyTorch's within
fp32 rounding.

Two stages, like the decode-attention kernel: stage 1, one program per (row, vocabulary split), reduces its slice to
(max, sum-exp, best key, best index); stage 2, one program per row, merges the splits. Splits let a small batch fill
the GPU; the grid comes from shapes and host values only (CUDA-graph safe, no host syncs).
Shapes: B rows, V vocabulary, N splits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tandem.kernels.fused import varying

BLOCK_V = 2048
MIN_VOCAB_PER_SPLIT = 4096
PROGRAMS_PER_SM = 16  # the pass is ALU-bound (hash, two logf, an IEEE divide per logit): many programs per SM


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the CPU interpreter: fewer programs run faster
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch_size: int, vocab_size: int, num_sms: int) -> int:
    """Enough (row, split) programs for `PROGRAMS_PER_SM` per SM, but no split under `MIN_VOCAB_PER_SPLIT`."""
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(1, batch_size))
    return max(1, min(wanted, triton.cdiv(vocab_size, MIN_VOCAB_PER_SPLIT)))


@triton.jit
def _mix32(x):
    """`sampler._mix32` on uint32 (multiplications wrap mod 2**32, shifts are logical)."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _log(x, INTERPRET: tl.constexpr):
    return tl.log(x) if INTERPRET else libdevice.log(x)


@triton.jit(**varying("temps_ptr", "seeds_ptr", "positions_ptr", "num_splits"))
def _split_kernel(logits_ptr, temps_ptr, seeds_ptr, positions_ptr, mid_m_ptr, mid_s_ptr, mid_key_ptr, mid_idx_ptr,
                  stride_lb, V, vocab_per_split, num_splits, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    b, split = tl.program_id(0), tl.program_id(1)
    temp = tl.load(temps_ptr + b).to(tl.float32)
    greedy = temp == 0.0
    temp = tl.where(greedy, 1.0, temp)
    # hash_uniform's per-row state: s = mix(mix(lo ^ mix(hi)) ^ position * golden), all mod 2**32
    seed = tl.load(seeds_ptr + b)
    row_state = _mix32(seed.to(tl.uint32) ^ _mix32((seed >> 32).to(tl.uint32)))
    row_state = _mix32(row_state ^ (tl.load(positions_ptr + b).to(tl.uint32) * 0x9E3779B1))

    start = split * vocab_per_split
    end = tl.minimum(start + vocab_per_split, V)
    m = tl.full([], float("-inf"), tl.float32)  # running max of logits / T
    s = tl.zeros([], tl.float32)  # running sum of exp(logits / T - m)
    best_key = tl.full([], float("-inf"), tl.float32)
    best_idx = start
    row_ptr = logits_ptr + b.to(tl.int64) * stride_lb
    for block_start in range(start, end, BLOCK):
        offs = block_start + tl.arange(0, BLOCK)
        mask = offs < end
        scaled = tl.math.div_rn(tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32), temp)
        u = ((_mix32(row_state + offs.to(tl.uint32) * 0x632BE5AB) >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608)
        key = tl.where(greedy, scaled, scaled + -_log(-_log(u, INTERPRET), INTERPRET))
        key = tl.where(mask, key, float("-inf"))
        block_best = tl.max(key, 0)
        block_idx = block_start + tl.argmax(key, 0)  # the first of equal maxima, as torch.argmax
        take = block_best > best_key  # strictly: an earlier block keeps a tie
        best_idx = tl.where(take, block_idx, best_idx)
        best_key = tl.where(take, block_best, best_key)
        m_new = tl.maximum(m, tl.max(scaled, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: no NaN from -inf - -inf
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(scaled - m_ref), 0)
        m = m_new
    out = b * num_splits + split
    tl.store(mid_m_ptr + out, m)
    tl.store(mid_s_ptr + out, s)
    tl.store(mid_key_ptr + out, best_key)
    tl.store(mid_idx_ptr + out, best_idx)


@triton.jit(**varying("temps_ptr", "num_splits"))
def _merge_kernel(logits_ptr, temps_ptr, mid_m_ptr, mid_s_ptr, mid_key_ptr, mid_idx_ptr, tokens_ptr, logprobs_ptr,
                  stride_lb, num_splits, BLOCK_SPLITS: tl.constexpr, INTERPRET: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_SPLITS)
    mask = offs < num_splits
    row = b * num_splits + offs
    m_n = tl.load(mid_m_ptr + row, mask=mask, other=float("-inf"))
    s_n = tl.load(mid_s_ptr + row, mask=mask, other=0.0)
    key_n = tl.load(mid_key_ptr + row, mask=mask, other=float("-inf"))
    idx_n = tl.load(mid_idx_ptr + row, mask=mask, other=0)
    token = tl.sum(tl.where(offs == tl.argmax(key_n, 0), idx_n, 0), 0)  # ties: the earliest split, lowest index
    m = tl.max(m_n, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(s_n * tl.exp(m_n - m), 0)
    temp = tl.load(temps_ptr + b).to(tl.float32)
    temp = tl.where(temp == 0.0, 1.0, temp)
    logit = tl.load(logits_ptr + b.to(tl.int64) * stride_lb + token).to(tl.float32)
    tl.store(tokens_ptr + b, token.to(tl.int64))
    tl.store(logprobs_ptr + b, tl.math.div_rn(logit, temp) - m - _log(s, INTERPRET))


def sample_gumbel(logits_BV: torch.Tensor, temperatures_B: torch.Tensor, seeds_B: torch.Tensor,
                  positions_B: torch.Tensor, num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampler.sample` for rows without top-k / top-p / min-p: (tokens [B] int64, logprobs [B] float32).

    logits_BV: fp32 or bf16 (read as fp32, as `sample` does), any row stride, last dim contiguous.
    temperatures_B: float, 0 = greedy (argmax of the logits, logprob at temperature 1).
    seeds_B, positions_B: int64, as in `SamplingBatch`: the noise is `hash_uniform(seeds, positions, V)`.
    num_splits: vocabulary splits per row; default `choose_num_splits` from B, V and the SM count.
    Assumes no NaN logits. Reads each logit once (plus one per row for the sampled token); allocates only [B, N]
    scratch; launches a grid fixed by shapes (graph safe).
    """
    B, V = logits_BV.shape
    assert logits_BV.stride(1) == 1, "the vocabulary dim must be contiguous"
    assert 0 < V < 2**31, V
    assert temperatures_B.shape == seeds_B.shape == positions_B.shape == (B,)
    assert seeds_B.dtype == torch.int64 and not positions_B.is_floating_point()
    device = logits_BV.device
    tokens_B = torch.empty(B, dtype=torch.int64, device=device)
    logprobs_B = torch.empty(B, dtype=torch.float32, device=device)
    if B == 0:
        return tokens_B, logprobs_B
    num_splits = num_splits or choose_num_splits(B, V, _num_sms(device))
    vocab_per_split = triton.cdiv(triton.cdiv(V, num_splits), BLOCK_V) * BLOCK_V  # whole blocks per split
    num_splits = triton.cdiv(V, vocab_per_split)  # no empty split
    mid_m, mid_s, mid_key = (torch.empty(B, num_splits, dtype=torch.float32, device=device) for _ in range(3))
    mid_idx = torch.empty(B, num_splits, dtype=torch.int32, device=device)
    interpret = bool(triton.knobs.runtime.interpret)  # the interpreter runs no extern (libdevice) calls
    _split_kernel[(B, num_splits)](
        logits_BV, temperatures_B, seeds_B, positions_B, mid_m, mid_s, mid_key, mid_idx,
        logits_BV.stride(0), V, vocab_per_split, num_splits, BLOCK=BLOCK_V, INTERPRET=interpret, num_warps=4,
    )
    # (the merge's block from the vocabulary, not the split count: one compiled variant for every batch size)
    _merge_kernel[(B,)](
        logits_BV, temperatures_B, mid_m, mid_s, mid_key, mid_idx, tokens_B, logprobs_B, logits_BV.stride(0),
        num_splits, BLOCK_SPLITS=triton.next_power_of_2(triton.cdiv(V, BLOCK_V)), INTERPRET=interpret, num_warps=1,
    )
    return tokens_B, logprobs_B
