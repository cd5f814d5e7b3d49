"""Tensor-parallel layers (Megatron's split): each rank holds a slice of every matrix.

- `ColumnParallelLinear`: output features split; no communication (its output stays sharded).
- `RowParallelLinear`: input features split; partial products summed with one all-reduce.
- `VocabParallelEmbedding` / `VocabParallelHead`: the vocabulary split; the embedding sums the ranks' rows
  (each rank contributes only the ids it owns), the head all-gathers the logits so every rank sees them all.

Every sharded layer records `tp_dim` (the dimension of the full weight it slices) and `tp_full_shape` (on the
module: a parameter's own attributes do not survive materialising a model built on the meta device), so weights
load from full (unsharded) tensors by name: `layouts(model)` says how each is cut and `shard` cuts this rank's
slice. A trainer therefore sends the same full tensors to a TP engine as to a single-GPU one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed import collectives


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group. `group`: the torch.distributed process group of the
    model's collectives (None: the default one)."""

    rank: int = 0
    size: int = 1
    group: object = None
    cpu_group: object = None  # a gloo group for the engine's control messages (None: `group`)

    def split(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"tensor parallelism: {what} ({n}) must be divisible by tp size {self.size}")
        return n // self.size


SINGLE = TPGroup()


def shard(full: torch.Tensor, dim: int | None, tp: TPGroup) -> torch.Tensor:
    """This rank's slice of a full tensor split along `dim` (None: not split, the tensor itself)."""
    if dim is None or tp.size == 1:
        return full
    return full.chunk(tp.size, dim)[tp.rank]


def layouts(model: nn.Module) -> dict[str, tuple[int | None, tuple[int, ...]]]:
    """For every parameter name: (the dimension its full tensor is split along or None, the full shape)."""
    out = {name: (None, tuple(p.shape)) for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if hasattr(module, "tp_dim"):
            out[f"{name}.weight"] = (module.tp_dim, module.tp_full_shape)
    return out


class ColumnParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, tp: TPGroup, what: str):
        super().__init__(in_features, tp.split(out_features, what), bias=False)
        self.tp_dim, self.tp_full_shape = 0, (out_features, in_features)


class RowParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, tp: TPGroup, what: str):
        super().__init__(tp.split(in_features, what), out_features, bias=False)
        self.tp_dim, self.tp_full_shape = 1, (out_features, in_features)
        self.tp = tp

    def forward(self, x):
        y = F.linear(x, self.weight)
        if self.tp.size > 1:
            collectives.all_reduce(y, group=self.tp.group)
        return y


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, dim: int, tp: TPGroup):
        super().__init__(tp.split(vocab_size, "vocab_size"), dim)
        self.tp_dim, self.tp_full_shape = 0, (vocab_size, dim)
        self.tp, self.start = tp, tp.rank * self.num_embeddings

    def forward(self, ids):
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        y = F.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None].to(self.weight.dtype)
        collectives.all_reduce(y, group=self.tp.group)
        return y


class VocabParallelHead(nn.Linear):
    def __init__(self, dim: int, vocab_size: int, tp: TPGroup):
        super().__init__(dim, tp.split(vocab_size, "vocab_size"), bias=False)
        self.tp_dim, self.tp_full_shape = 0, (vocab_size, dim)
        self.tp = tp

    def forward(self, x):
        y_NV = F.linear(x, self.weight)
        if self.tp.size == 1:
            return y_NV
        parts = [torch.empty_like(y_NV) for _ in range(self.tp.size)]
        collectives.all_gather(parts, y_NV.contiguous(), group=self.tp.group)
        return torch.cat(parts, dim=-1)
