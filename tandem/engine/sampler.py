"""Batched sampling with exact log-probabilities and per-request reproducible noise.

Log-probabilities: `output_logprobs[i]` is log softmax(logits / temperature) of the sampled token, i.e.
under the temperature-scaled distribution *before* top-k / top-p / min-p truncation (the same convention
as SGLang and vLLM's default; a trainer recomputing logprobs with the same temperature reproduces it).
For greedy requests (temperature 0) it is the log-probability under temperature 1.

Noise: sampling is Gumbel-max over the filtered logits with uniforms from an integer hash of
(request seed, output position, vocabulary index). A request's tokens therefore depend only on its seed,
its context and the weights, not on what else is batched with it, on retraction, or on the device: the
hash is exact integer arithmetic, identical on CPU and GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply) on int64 tensors holding values < 2**32. int64
    products wrap modulo 2**64, which keeps the low 32 bits exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def hash_uniform(seeds_B: torch.Tensor, positions_B: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1), [B, V] float32, a pure function of (seed, position, vocab index)."""
    s = _mix32((seeds_B & _M32) ^ _mix32((seeds_B >> 32) & _M32))
    s = _mix32(s ^ ((positions_B * 0x9E3779B1) & _M32))
    v = torch.arange(vocab_size, device=seeds_B.device, dtype=torch.int64)
    x = _mix32((s[:, None] + v[None] * 0x632BE5AB) & _M32)
    # 23 bits, centred: (k + 0.5) / 2**23 is exact in float32 and lies in [2**-24, 1 - 2**-24], never 0 or 1
    # (a uniform of exactly 1 would be infinite Gumbel noise, sampling that token whatever its probability)
    return ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))


@functools.cache
def _fused_sampler():
    try:
        from tandem.kernels.sampling import sample_gumbel
    except ImportError:  # no Triton
        return None
    return sample_gumbel


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors on the logits' device."""

    temperatures: torch.Tensor  # [B] float, 0 = greedy
    top_ps: torch.Tensor  # [B] float
    top_ks: torch.Tensor  # [B] int, <= 0 disables
    min_ps: torch.Tensor  # [B] float
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64: index of the token being sampled among the request's outputs
    # whether any row asks for top-k / top-p / min-p: known on the host, so sampling never syncs the device
    needs_filter: bool = True
    # (rows, token ids) that cannot be sampled (a request's EOS and stop tokens before its min_new_tokens), or None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    top_logprobs_num: int = 0  # the most any row asks for (`top_logprobs`)


def with_requests(batch: SamplingBatch, reqs, eos_token_id: int | None) -> SamplingBatch:
    """`batch` with what its requests (`tandem.engine.request.Request`, one per row) ask beyond the sampling
    parameters: tokens banned while a request has fewer than `min_new_tokens` outputs (EOS unless it ignores EOS,
    and its stop tokens), and how many top logprobs to keep."""
    rows, ids = [], []
    for row, req in enumerate(reqs):
        sp = req.sampling
        if sp.min_new_tokens and req.num_generated < sp.min_new_tokens:
            stops = [*sp.stop_token_ids, *([eos_token_id] if eos_token_id is not None and not sp.ignore_eos else [])]
            rows += [row] * len(stops)
            ids += stops
    device = batch.seeds.device
    if rows:  # (through pinned memory on CUDA: a pageable copy would make the host wait for the step in flight)
        banned = torch.tensor([rows, ids])
        banned = banned.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else banned.to(device)
        batch.banned = (banned[0], banned[1])
    batch.top_logprobs_num = max((r.sampling.top_logprobs_num for r in reqs), default=0)
    return batch


def sample(logits_BV: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (token ids [B] int64, logprobs [B] float32). On CUDA, batches without truncation go through one
    fused Triton pass over the logits (`tandem.kernels.sampling`, the same tokens)."""
    logits_BV = _ban(logits_BV, batch)
    if logits_BV.is_cuda and not batch.needs_filter and _fused_sampler() is not None:
        return _fused_sampler()(logits_BV, batch.temperatures, batch.seeds, batch.positions)
    logits_BV = logits_BV.float()
    greedy = batch.temperatures == 0
    temps = torch.where(greedy, torch.ones_like(batch.temperatures), batch.temperatures)
    scaled_BV = logits_BV / temps[:, None]
    logprobs_BV = torch.log_softmax(scaled_BV, dim=-1)
    filtered_BV = _filter(scaled_BV, batch)
    gumbel_BV = -torch.log(-torch.log(hash_uniform(batch.seeds, batch.positions, logits_BV.shape[-1])))
    sampled = torch.argmax(filtered_BV + gumbel_BV, dim=-1)
    tokens = torch.where(greedy, torch.argmax(logits_BV, dim=-1), sampled)
    return tokens, logprobs_BV.gather(1, tokens[:, None])[:, 0]


def top_logprobs(logits_BV: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The `batch.top_logprobs_num` most likely tokens of each row's distribution (the one `sample`'s logprobs are
    of: temperature-scaled, before truncation, banned tokens out): (logprobs [B, k] float32, ids [B, k] int64),
    most likely first; None when no row asks for them."""
    k = min(batch.top_logprobs_num, logits_BV.shape[-1])
    if k <= 0:
        return None
    temps = torch.where(batch.temperatures == 0, torch.ones_like(batch.temperatures), batch.temperatures)
    logprobs_BV = torch.log_softmax(_ban(logits_BV, batch).float() / temps[:, None], dim=-1)
    return torch.topk(logprobs_BV, k, dim=-1)


def _ban(logits_BV: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.banned is None:
        return logits_BV
    return logits_BV.index_put(batch.banned, torch.tensor(float("-inf"), dtype=logits_BV.dtype,
                                                          device=logits_BV.device))


def _filter(scaled_BV, batch: SamplingBatch):
    """Mask (to -inf) tokens outside each row's top-k, top-p nucleus and min-p floor."""
    if not batch.needs_filter:
        return scaled_BV
    V = scaled_BV.shape[-1]
    sorted_BV, order_BV = torch.sort(scaled_BV, dim=-1, descending=True)
    rank = torch.arange(V, device=scaled_BV.device)[None]
    top_k = torch.where(batch.top_ks > 0, batch.top_ks, V)[:, None]
    drop = rank >= top_k
    # top-p and min-p act on the distribution renormalised after top-k (as SGLang and vLLM do)
    probs_BV = torch.softmax(sorted_BV.masked_fill(drop, float("-inf")), dim=-1)
    # nucleus: keep the smallest prefix whose mass reaches top_p (the token crossing it stays)
    # only rows that asked for it: a float32 cumsum can reach 1 before the tail and would drop tail tokens
    # of a top_p = 1 row batched with rows that filter
    drop |= ((probs_BV.cumsum(-1) - probs_BV) >= batch.top_ps[:, None]) & (batch.top_ps < 1)[:, None]
    drop |= probs_BV < batch.min_ps[:, None] * probs_BV[:, :1]
    drop[:, 0] = False
    mask_BV = torch.zeros_like(drop).scatter(1, order_BV, drop)
    return scaled_BV.masked_fill(mask_BV, float("-inf"))
