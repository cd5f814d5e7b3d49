"""Tensor-parallel layers (Megatron's split): each rank holds a slice of every matrix.

- `ColumnParallelLinear`: output features split; no communication (its output stays sharded).
- `RowParallelLinear`: input features split; partial products summed with one all-reduce.
- `VocabParallelEmbedding` / `VocabParallelHead`: the vocabulary split; the embedding sums the ranks' rows
  (each rank contributes only the ids it owns), the head all-gathers the logits so every rank sees them all.
  Any vocabulary size: each rank holds `cdiv(vocab_size, tp)` rows, the last ranks' rows past the vocabulary are
  padding (zero, never loaded, their logits dropped).

Every sharded layer records `tp_dim` (the dimension of the full weight it slices) and `tp_full_shape` (on the
module: a parameter's own attributes do not survive materialising a model built on the meta device), so weights
load from full (unsharded) tensors by name: `layouts(model)` says how each is cut, `shard` cuts this rank's
slice and `shard_into` pairs it with the part of the parameter it fills. A trainer therefore sends the same full
tensors to a TP engine as to a single-GPU one. A module whose parameters are cut over another group (a
mixture-of-experts layer's experts, over the expert-parallel ranks) lists them in `shard_layouts`:
{parameter name: `Layout`}.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed import collectives


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in a group of ranks. `group`: the torch.distributed process group of its collectives
    (None: the default one).

    An engine's group holds all its ranks (its lockstep, its sampled-token broadcast). Under expert parallelism
    (`init_tp(..., ep=N)`) its ranks form a grid of tp x ep: `dense` is this rank's group of the ranks the dense
    layers are split over (attention, dense MLPs, embedding, head), `experts` its group of the ranks a
    mixture-of-experts model's experts are split over. Without them the dense layers are split over all ranks
    and every rank holds every expert."""

    rank: int = 0
    size: int = 1
    group: object = None
    cpu_group: object = None  # a gloo group for the engine's control messages (None: `group`)
    kind: str = "tensor"  # what is split over it, for error messages
    dense: TPGroup | None = None
    experts: TPGroup | None = None

    def split(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{self.kind} parallelism: {what} ({n}) must be divisible by its size {self.size}")
        return n // self.size

    @property
    def dense_group(self) -> TPGroup:
        return self if self.dense is None else self.dense

    @property
    def expert_group(self) -> TPGroup:
        return SINGLE if self.experts is None else self.experts


SINGLE = TPGroup()


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (b > 0)."""
    return -(-a // b)


def real_rows(n: int, rank: int, size: int) -> tuple[int, int]:
    """(first row, number of rows) of a length-`n` dimension that rank `rank` of `size` holds: blocks of
    `cdiv(n, size)` rows, the last ones cut short (or empty) at n. A padded layer holds `cdiv(n, size)` rows on
    every rank; those past the count are padding."""
    rows = cdiv(n, size)
    start = min(rank * rows, n)
    return start, min(rows, n - start)


def shard(full: torch.Tensor, dim: int | None, tp: TPGroup) -> torch.Tensor:
    """This rank's slice of a full tensor split along `dim` (None: not split, the tensor itself): its
    `real_rows`, so fewer rows than a padded parameter holds where the split is uneven."""
    if dim is None or tp.size == 1:
        return full
    return full.narrow(dim, *real_rows(full.shape[dim], tp.rank, tp.size))


def shard_into(param: torch.Tensor, full: torch.Tensor, dim: int | None,
               tp: TPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """(the view of this rank's `param` that its slice of `full` fills, that slice), to copy one into the other:
    all of `param`, except in a padded layer, whose padding rows are left as they are (zero)."""
    part = shard(full, dim, tp)
    if part.shape == param.shape:
        return param, part
    return param.narrow(dim, 0, part.shape[dim]), part


class Layout(NamedTuple):
    """How a parameter is cut from its full tensor: along `dim` (None: not cut) over the ranks of `group`."""

    dim: int | None
    shape: tuple[int, ...]  # the full tensor's
    group: TPGroup = SINGLE


def layouts(model: nn.Module) -> dict[str, Layout]:
    """Every parameter's `Layout`, by name."""
    out = {name: Layout(None, tuple(p.shape)) for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if hasattr(module, "tp_dim"):
            out[f"{prefix}weight"] = Layout(module.tp_dim, module.tp_full_shape, module.tp_group)
        for param, layout in getattr(module, "shard_layouts", {}).items():
            out[f"{prefix}{param}"] = layout
    return out


class ColumnParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, tp: TPGroup, what: str):
        super().__init__(in_features, tp.split(out_features, what), bias=False)
        self.tp_dim, self.tp_full_shape, self.tp_group = 0, (out_features, in_features), tp


class RowParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, tp: TPGroup, what: str):
        super().__init__(tp.split(in_features, what), out_features, bias=False)
        self.tp_dim, self.tp_full_shape, self.tp_group = 1, (out_features, in_features), tp
        self.tp = tp

    def forward(self, x):
        y = F.linear(x, self.weight)
        if self.tp.size > 1:
            collectives.all_reduce(y, group=self.tp.group)
        return y


class VocabShard:
    """What the two vocabulary-parallel layers share: this rank holds `cdiv(vocab_size, tp)` rows of the
    [vocab_size, dim] weight, of which `num_real` from vocabulary id `start` on are real, the rest padding."""

    def _shard_vocab(self, vocab_size: int, dim: int, tp: TPGroup) -> None:
        self.tp_dim, self.tp_full_shape, self.tp, self.tp_group = 0, (vocab_size, dim), tp, tp
        self.start, self.num_real = real_rows(vocab_size, tp.rank, tp.size)
        self.zero_padding()

    @torch.no_grad()
    def zero_padding(self) -> None:
        self.weight[self.num_real:].zero_()


def zero_padding(model: nn.Module) -> None:
    """Zero the padding rows of every vocabulary-parallel layer (after `to_empty`, which leaves them garbage)."""
    for module in model.modules():
        if isinstance(module, VocabShard):
            module.zero_padding()


class VocabParallelEmbedding(nn.Embedding, VocabShard):
    def __init__(self, vocab_size: int, dim: int, tp: TPGroup):
        super().__init__(cdiv(vocab_size, tp.size), dim)
        self._shard_vocab(vocab_size, dim, tp)

    def forward(self, ids):
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_real)
        y = F.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None].to(self.weight.dtype)
        collectives.all_reduce(y, group=self.tp.group)
        return y


class VocabParallelHead(nn.Linear, VocabShard):
    """`forward(x_NE)` -> logits [N, vocab_size] on every rank (the padding columns dropped)."""

    def __init__(self, dim: int, vocab_size: int, tp: TPGroup):
        super().__init__(dim, cdiv(vocab_size, tp.size), bias=False)
        self._shard_vocab(vocab_size, dim, tp)
        self.num_real_per_rank = [real_rows(vocab_size, r, tp.size)[1] for r in range(tp.size)]

    def forward(self, x):
        y_NV = F.linear(x, self.weight)
        if self.tp.size == 1:
            return y_NV
        parts = [torch.empty_like(y_NV) for _ in range(self.tp.size)]
        collectives.all_gather(parts, y_NV.contiguous(), group=self.tp.group)
        return torch.cat([part[..., :n] for part, n in zip(parts, self.num_real_per_rank, strict=True)], dim=-1)
