"""Attention contexts: the seam between the model and where its keys and values live.

The model computes q, k, v for a flat batch of tokens and hands them to `ctx.attend(layer, q, k, v)`.
A context decides what each query attends to:
  - `PackedCausal`: several sequences packed end to end, causal within each, no cache (the trainer,
    and reference checks).
  - `PagedAttention`: the engine's paged KV cache; each sequence's new tokens attend to its cached
    prefix plus themselves (the PyTorch reference, with Python lists per sequence).
  - `BlockTablePrefill`, `BlockTableDecode`: the same over block tables in device tensors only, through a
    kernel (Triton on GPU: `tandem.kernels`); the decode one is fixed-shape, for CUDA graphs.

Shapes: T tokens in the flat batch, H query heads, K key/value heads, D head dim, S KV-cache slots.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F


class AttentionContext:
    """Contract: `attend(layer, q_THD, k_TKD, v_TKD) -> o_THD`. May write k and v into a cache (the only
    mutation); must not keep references to q, k, v after returning."""

    def attend(self, layer: int, q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def kv_destination(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k_cache_SKD, v_cache_SKD, slots_T): where `attend` would write this step's keys and values, for a caller
        that writes them itself and then passes k and v as None; None when `attend` must be given them."""
        return None

    def token_slots(self) -> torch.Tensor | None:
        """The KV cache slot of each of the step's tokens [T] (what else is kept slot by slot goes there too);
        None without a cache."""
        return None

    def takes_fresh(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether `attend_fresh` may be called with activations of this dtype and head dim."""
        return False

    def attend_fresh(self, layer: int, q_THD: torch.Tensor, fresh: Fresh) -> torch.Tensor:
        """`attend` given the step's queries, keys and values as the q/k/v projection gives them: q/k RMSNorm and
        RoPE (`fresh`'s weights, at its positions) are applied inside attention, and the keys and values written
        into the cache there (at `fresh.slots_B`). Only where `takes_fresh`."""
        raise NotImplementedError


class Fresh(NamedTuple):
    """A decode step's new keys and values as its q/k/v projection gives them (before q/k RMSNorm and RoPE), and
    what those need (`AttentionContext.attend_fresh`)."""

    k_BKD: torch.Tensor
    v_BKD: torch.Tensor
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    positions_B: torch.Tensor
    slots_B: torch.Tensor
    theta: float
    eps: float


def _sdpa(q_BHQD, k_BKLD, v_BKLD, mask_BQL):
    num_groups = q_BHQD.shape[1] // k_BKLD.shape[1]
    if num_groups > 1:
        k_BKLD = k_BKLD.repeat_interleave(num_groups, dim=1)
        v_BKLD = v_BKLD.repeat_interleave(num_groups, dim=1)
    return F.scaled_dot_product_attention(q_BHQD, k_BKLD, v_BKLD, attn_mask=mask_BQL[:, None])


@functools.cache
def varlen_attention():
    """PyTorch's variable-length flash attention with its causal and GQA options, across the two forms its
    signature has had: `(fn, causal kwargs, takes GQA)`, or None where it is missing. Looked up at first use:
    importing it imports torch's compiler stack (seconds), which CPU-only processes never need."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        return varlen_attn, {"window_size": (-1, 0)}, "enable_gqa" in params
    if "is_causal" in params:
        return varlen_attn, {"is_causal": True}, False
    return None


def __getattr__(name: str):
    if name == "VARLEN":  # (the lookup's result under its former module-level name)
        return varlen_attention()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class PackedCausal(AttentionContext):
    """Sequences of lengths `seq_lens` packed into one flat batch, causal within each. On CUDA in bf16/fp16 one
    variable-length flash attention call over the whole batch; elsewhere one SDPA call per sequence (the
    reference; on CUDA a call per sequence costs a kernel plan per new length, which made a training step
    host-bound)."""

    seq_lens: list[int]
    fused: bool = True  # False: the per-sequence reference everywhere
    _cu_seqlens: torch.Tensor | None = field(default=None, repr=False)

    def attend(self, layer, q_THD, k_TKD, v_TKD):
        if (self.fused and q_THD.is_cuda and q_THD.dtype in (torch.bfloat16, torch.float16)
                and varlen_attention() is not None):
            return self._varlen(q_THD, k_TKD, v_TKD)
        outs, start = [], 0
        for n in self.seq_lens:
            q, k, v = (x[start:start + n].transpose(0, 1)[None] for x in (q_THD, k_TKD, v_TKD))
            mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[None]
            outs.append(_sdpa(q, k, v, mask)[0].transpose(0, 1))
            start += n
        return torch.cat(outs)

    def _varlen(self, q_THD, k_TKD, v_TKD):
        fn, causal, gqa = varlen_attention()
        if self._cu_seqlens is None:  # once per batch, shared by every layer
            lens = torch.tensor([0, *self.seq_lens], dtype=torch.int32)
            self._cu_seqlens = lens.cumsum(0, dtype=torch.int32).to(q_THD.device, non_blocking=True)
        groups = q_THD.shape[1] // k_TKD.shape[1]
        if groups > 1 and not gqa:
            k_TKD, v_TKD = k_TKD.repeat_interleave(groups, dim=1), v_TKD.repeat_interleave(groups, dim=1)
        extra = {"enable_gqa": True} if groups > 1 and gqa else {}
        n = max(self.seq_lens)
        return fn(q_THD, k_TKD, v_TKD, self._cu_seqlens, self._cu_seqlens, n, n, **causal, **extra)


@dataclass
class PagedAttention(AttentionContext):
    """The engine's batch against its paged KV cache (PyTorch reference).

    k_cache / v_cache: [num_layers, S, K, D] slot-major views of the page pool (slot = page * page_size +
    offset). Each sequence b contributes `q_lens[b]` new tokens (contiguous in the flat batch, in order)
    whose keys and values go to `new_slots` [T]; sequence b then attends causally over its first
    `kv_lens[b]` positions, whose slots are `kv_slots[b]` (a [kv_lens[b]] int tensor)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    new_slots: torch.Tensor
    q_lens: list[int]
    kv_lens: list[int]
    kv_slots: list[torch.Tensor]
    # Optional: decode rows through a paged-decode kernel (`paged_decode_reference`'s signature) over these
    # block tables, one row per decode sequence in order, instead of gathering their whole context.
    decode_kernel: object = None
    decode_block_table: torch.Tensor | None = None
    page_size: int = 0
    _plans: dict = field(default_factory=dict, repr=False)  # row group -> (slots, mask), the same in every layer

    def token_slots(self):
        return self.new_slots

    def attend(self, layer, q_THD, k_TKD, v_TKD):
        self.k_cache[layer, self.new_slots] = k_TKD.to(self.k_cache.dtype)
        self.v_cache[layer, self.new_slots] = v_TKD.to(self.v_cache.dtype)
        out_THD = torch.empty_like(q_THD)
        starts = [0]
        for n in self.q_lens:
            starts.append(starts[-1] + n)
        # Decode rows (one query each) are batched into one call; prefill chunks go one by one so a long
        # chunk does not pad every decode row to its length.
        decode = [b for b, n in enumerate(self.q_lens) if n == 1]
        if decode and self.decode_kernel is not None:
            # built on the host and copied without a sync, so an overlapped step does not wait for the last one
            rows = torch.tensor([starts[b] for b in decode]).to(q_THD.device, non_blocking=True)
            seq_lens = torch.tensor([self.kv_lens[b] for b in decode], dtype=torch.int32).to(q_THD.device,
                                                                                              non_blocking=True)
            out_THD[rows] = self.decode_kernel(q_THD[rows], self.k_cache[layer], self.v_cache[layer],
                                               self.decode_block_table, seq_lens, self.page_size,
                                               q_THD.shape[-1] ** -0.5)
        elif decode:
            self._attend_batch(layer, decode, starts, q_THD, out_THD)
        for b, n in enumerate(self.q_lens):
            if n > 1:
                self._attend_batch(layer, [b], starts, q_THD, out_THD)
        return out_THD

    def _plan(self, rows: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [R, L] and mask [R, Q, L] of a group of rows: the same in every layer, so built once a step."""
        plans, key = self._plans, tuple(rows)
        if key not in plans:
            q_max = max(self.q_lens[b] for b in rows)
            kv_max = max(self.kv_lens[b] for b in rows)
            slots = torch.zeros(len(rows), kv_max, dtype=torch.long, device=device)
            mask = torch.zeros(len(rows), q_max, kv_max, dtype=torch.bool, device=device)
            for i, b in enumerate(rows):
                n, kv = self.q_lens[b], self.kv_lens[b]
                slots[i, :kv] = self.kv_slots[b]
                # query j sits at position kv - n + j and sees keys 0 .. kv - n + j
                pos = torch.arange(kv - n, kv, device=device)
                mask[i, :n, :kv] = torch.arange(kv, device=device)[None] <= pos[:, None]
                mask[i, n:, 0] = True  # padded queries: attend to something, result discarded
            plans[key] = slots, mask
        return plans[key]

    def _attend_batch(self, layer, rows, starts, q_THD, out_THD):
        slots, mask = self._plan(rows, q_THD.device)
        q_BQHD = q_THD.new_zeros(len(rows), mask.shape[1], *q_THD.shape[1:])
        for i, b in enumerate(rows):
            q_BQHD[i, :self.q_lens[b]] = q_THD[starts[b]:starts[b] + self.q_lens[b]]
        k_BLKD = self.k_cache[layer][slots].to(q_THD.dtype)
        v_BLKD = self.v_cache[layer][slots].to(q_THD.dtype)
        o_BHQD = _sdpa(q_BQHD.transpose(1, 2), k_BLKD.transpose(1, 2), v_BLKD.transpose(1, 2), mask)
        o_BQHD = o_BHQD.transpose(1, 2)
        for i, b in enumerate(rows):
            out_THD[starts[b]:starts[b] + self.q_lens[b]] = o_BQHD[i, :self.q_lens[b]]


def paged_decode_reference(q_BHD, k_cache_SKD, v_cache_SKD, block_table_BP, seq_lens_B, page_size: int,
                           scale: float) -> torch.Tensor:
    """One query per request against its first `seq_lens[b]` cached positions, found through its block
    table (page ids). The PyTorch reference of the GPU decode kernel: same arguments, same result."""
    B, P = block_table_BP.shape
    pos_L = torch.arange(P * page_size, device=q_BHD.device)
    slots_BL = block_table_BP.long()[:, pos_L // page_size] * page_size + pos_L % page_size
    k_BLKD = k_cache_SKD[slots_BL].float()
    v_BLKD = v_cache_SKD[slots_BL].float()
    mask_BL = pos_L[None] < seq_lens_B[:, None]
    groups = q_BHD.shape[1] // k_BLKD.shape[2]
    k_BLHD = k_BLKD.repeat_interleave(groups, dim=2)
    v_BLHD = v_BLKD.repeat_interleave(groups, dim=2)
    scores_BHL = torch.einsum("bhd,blhd->bhl", q_BHD.float(), k_BLHD) * scale
    scores_BHL = scores_BHL.masked_fill(~mask_BL[:, None], float("-inf"))
    probs_BHL = torch.softmax(scores_BHL, dim=-1).nan_to_num(0.0)  # rows with seq_len 0 (padding) give zeros
    return torch.einsum("bhl,blhd->bhd", probs_BHL, v_BLHD).to(q_BHD.dtype)


@functools.cache
def _takes_argument(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


@dataclass
class BlockTableDecode(AttentionContext):
    """A decode batch in fixed-shape tensors only (no Python lists), so the whole forward can be captured in
    a CUDA graph: request b's new key/value goes to `slots_B[b]`, then its query attends over its first
    `seq_lens_B[b]` positions through `block_table_BP[b]`. `kernel` has `paged_decode_reference`'s
    signature (the Triton kernel on GPU). Padding rows have seq_len 0 and write to a scratch slot."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots_B: torch.Tensor
    block_table_BP: torch.Tensor
    seq_lens_B: torch.Tensor
    page_size: int
    kernel: object = paged_decode_reference

    def kv_destination(self, layer):
        return self.k_cache[layer], self.v_cache[layer], self.slots_B

    def token_slots(self):
        return self.slots_B

    def takes_fresh(self, dtype, head_dim):
        from tandem.kernels.limits import takes_fresh

        return _takes_argument(self.kernel, "fresh") and dtype == self.k_cache.dtype and takes_fresh(head_dim)

    def attend_fresh(self, layer, q_THD, fresh):
        return self._kernel(layer, q_THD, fresh=fresh)

    def attend(self, layer, q_THD, k_TKD, v_TKD):
        if k_TKD is not None:
            self.k_cache[layer].index_copy_(0, self.slots_B, k_TKD.to(self.k_cache.dtype))
            self.v_cache[layer].index_copy_(0, self.slots_B, v_TKD.to(self.v_cache.dtype))
        return self._kernel(layer, q_THD)

    def _kernel(self, layer, q_THD, **options):
        return self.kernel(q_THD, self.k_cache[layer], self.v_cache[layer], self.block_table_BP, self.seq_lens_B,
                           self.page_size, q_THD.shape[-1] ** -0.5, **options)


@dataclass
class BlockTablePrefill(AttentionContext):
    """Any step (chunks of any length) through a paged-prefill kernel (`paged_prefill_attention`'s signature):
    sequence b's queries are rows `q_starts_B1[b] .. q_starts_B1[b + 1] - 1` of the flat batch, their keys and
    values go to `new_slots_T`, and query j attends causally over the first `kv_lens_B[b] - q_len_b + j + 1`
    positions found through `block_table_BP[b]`. No Python loop per sequence, nothing gathered."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    new_slots_T: torch.Tensor
    block_table_BP: torch.Tensor
    q_starts_B1: torch.Tensor
    kv_lens_B: torch.Tensor
    page_size: int
    max_q_len: int
    kernel: object

    def kv_destination(self, layer):
        return self.k_cache[layer], self.v_cache[layer], self.new_slots_T

    def token_slots(self):
        return self.new_slots_T

    def attend(self, layer, q_THD, k_TKD, v_TKD):
        if k_TKD is not None:
            self.k_cache[layer].index_copy_(0, self.new_slots_T, k_TKD.to(self.k_cache.dtype))
            self.v_cache[layer].index_copy_(0, self.new_slots_T, v_TKD.to(self.v_cache.dtype))
        return self.kernel(q_THD, self.k_cache[layer], self.v_cache[layer], self.block_table_BP, self.q_starts_B1,
                           self.kv_lens_B, self.page_size, q_THD.shape[-1] ** -0.5, self.max_q_len)
