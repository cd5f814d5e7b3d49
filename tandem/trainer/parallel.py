"""How the trainer spreads over ranks and saves memory: FSDP2 sharding, the split of a batch's episodes across
data-parallel ranks, the reduction of metrics, the full weights gathered for the engine, and activation
checkpointing.

Under FSDP every rank receives the whole batch, computes the advantages of every group itself, and trains on its
share of the episodes (`split_episodes`). The gradient of the batch is the sum over ranks of each rank's gradient
weighted by its policy tokens over the batch's, so FSDP must sum gradients rather than average them
(`shard_model` sets that up).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

from tandem.distributed import collectives
from tandem.model.qwen3 import Qwen3ForCausalLM


def checkpoint_layers(model: Qwen3ForCausalLM) -> None:
    """Recompute each decoder layer's activations in the backward pass instead of keeping them: memory of one
    layer's activations plus each layer's input, for about one more forward pass. Mutates `model` in place
    (parameter names are unchanged)."""
    for layer in model.model.layers:
        # An instance attribute: nn.Module.__call__ (and FSDP's hooks around it) then run the checkpointed forward.
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def shard_model(model: Qwen3ForCausalLM, param_dtype: torch.dtype) -> Qwen3ForCausalLM:
    """Shard `model` (float32) in place with FSDP2 over all ranks of the default process group: one unit per decoder
    layer, then the root (embedding, final norm, head). The sharded float32 parameters are the master weights the
    optimizer steps; forward and backward run on all-gathered `param_dtype` copies, and gradients are reduced in
    float32. Gradients are summed over ranks, not averaged (see the module docstring)."""
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    # The root keeps its parameters gathered after forward: the trainer calls `compute_logits` (the head) outside
    # the root's forward.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # divide factor 1 = a plain sum; forcing SUM also keeps gloo working (it has no PREMUL_SUM)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def split_episodes(lengths: list[int], world: int) -> list[list[int]]:
    """Episode indices for each of `world` ranks, each list in batch order: longest episode first, each to the rank
    with the fewest tokens so far (the lowest rank on a tie), so ranks get about equal compute. A function of
    `lengths` alone, so every rank computes the same split."""
    loads, shares = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += lengths[i]
    return [sorted(share) for share in shares]


def sync_batch(local_tokens: int, num_micro_batches: int, batch_tokens: int, device) -> tuple[int, int]:
    """All ranks' policy tokens summed, and the most micro-batches any rank has (every rank must run that many
    forward and backward passes: FSDP's collectives pair up across ranks). Raises RuntimeError when the ranks were
    handed different batches (their `batch_tokens` differ, or the shares do not add up to the batch)."""
    total = torch.tensor([local_tokens], dtype=torch.int64, device=device)
    sizes = torch.tensor([num_micro_batches, batch_tokens, -batch_tokens], dtype=torch.int64, device=device)
    collectives.all_reduce(total)
    collectives.all_reduce(sizes, op=dist.ReduceOp.MAX)
    if not total.item() == sizes[1].item() == -sizes[2].item() == batch_tokens:
        raise RuntimeError(f"trainer: rank {dist.get_rank()} holds a batch of {batch_tokens} policy tokens, but the "
                           f"ranks' shares add up to {total.item()}: the ranks were given different batches")
    return int(total.item()), int(sizes[0].item())


def reduce_metrics(sums: dict[str, float], extremes: dict[str, float], device) -> None:
    """In place over all ranks: sum `sums`; the max of `extremes` keys ending in `_max`, the min of the others.
    Every rank must hold the same keys."""
    keys, ext = sorted(sums), sorted(extremes)
    s = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=device)
    e = torch.tensor([extremes[k] if k.endswith("_max") else -extremes[k] for k in ext], dtype=torch.float64,
                     device=device)
    collectives.all_reduce(s)
    collectives.all_reduce(e, op=dist.ReduceOp.MAX)
    sums.update(zip(keys, s.tolist(), strict=True))
    extremes.update((k, v if k.endswith("_max") else -v) for k, v in zip(ext, e.tolist(), strict=True))


GATHER_BUCKET_BYTES = 32 << 20  # of full weights (in the compute dtype) one all-gather of `gathered` makes at most


def gathered(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
             bucket_bytes: int = GATHER_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor in `dtype`) for each of `named`, in order: FSDP's parameters (DTensors sharded on dim 0
    over a 1-d mesh) gathered a bucket of up to `bucket_bytes` at a time in one all-gather, not one a parameter
    (fewer collectives; a bucket costs a copy in and a copy out), bit for bit what each one's `full_tensor()`
    gives; any other DTensor by its own `full_tensor()`, a plain tensor as it is (detached). A collective: every
    rank iterates it to the end, with the same parameters and `bucket_bytes`."""
    bucket, size, buffers = [], 0, _Buffers()
    for name, p in named:
        if not _dim0_sharded(p):
            yield from _gather_bucket(bucket, dtype, buffers)
            bucket, size = [], 0
            yield name, (p.detach().to(dtype).full_tensor() if isinstance(p, DTensor) else p.detach())
            continue
        nbytes = p.numel() * dtype.itemsize
        if bucket and (size + nbytes > bucket_bytes or p.device_mesh != bucket[0][1].device_mesh):  # (one group)
            yield from _gather_bucket(bucket, dtype, buffers)
            bucket, size = [], 0
        bucket.append((name, p))
        size += nbytes
    yield from _gather_bucket(bucket, dtype, buffers)


class _Buffers:
    """A rank's part and every rank's parts of a bucket, kept for the next bucket (grown when one needs more): a
    fresh buffer a bucket costs its pages' first touch each time."""

    def __init__(self):
        self.part = self.parts = None

    def get(self, numel: int, world: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.part is None or self.part.numel() < numel:
            self.part = torch.empty(numel, dtype=dtype, device=device)
            self.parts = torch.empty(world * numel, dtype=dtype, device=device)
        return self.part[:numel], self.parts[:world * numel]


def _dim0_sharded(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),) and p.ndim > 0


def _gather_bucket(bucket: list[tuple[str, DTensor]], dtype: torch.dtype,
                   buffers: _Buffers) -> Iterator[tuple[str, torch.Tensor]]:
    """One all-gather of the bucket's local shards, each padded to its whole chunk (`torch.chunk`'s split of dim 0,
    as FSDP shards: the first ranks hold ceil(rows / world) rows, the last ones fewer or none), laid end to end in
    the same order on every rank; then each full tensor cut out of every rank's part."""
    if not bucket:
        return
    group = bucket[0][1].device_mesh.get_group()
    world, rank, device = dist.get_world_size(group), dist.get_rank(group), bucket[0][1].to_local().device
    layout, offset = [], 0  # per parameter: where its chunk starts in a rank's part, its rows a chunk, a row's size
    for _, p in bucket:
        chunk, row = -(-p.shape[0] // world), math.prod(p.shape[1:])
        layout.append((offset, chunk, row))
        offset += chunk * row
    part, parts = buffers.get(offset, world, dtype, device)  # (the padding is sent, never read back)
    for (name, p), (start, chunk, _) in zip(bucket, layout, strict=True):
        local = p.to_local()
        assert local.shape[0] == _rows(p.shape[0], chunk, rank), (name, local.shape, p.shape)
        part[start:start + local.numel()].copy_(local.detach().reshape(-1))  # (rounded to dtype as `.to` rounds)
    collectives.all_gather_single(parts, part, group=group)
    parts = parts.view(world, offset)
    for (name, p), (start, chunk, row) in zip(bucket, layout, strict=True):
        pieces = [parts[r, start:start + _rows(p.shape[0], chunk, r) * row] for r in range(world)]
        yield name, torch.cat(pieces).view(p.shape)


def _rows(rows: int, chunk: int, rank: int) -> int:
    """Rows of dim 0 that `rank` holds when `rows` are cut into chunks of `chunk`."""
    return max(0, min(chunk, rows - rank * chunk))
