"""Flat buckets: how named tensors travel as a few flat tensors, each with its metadata (`BucketMeta`), and how a
receiver reads them back (`FlatTensors`, tensors back to back in their order)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from tandem.transport.weights import NamedTensors, TransportError, validated


@dataclass
class BucketMeta:
    """The header of one bucket: a flat tensor of `numel` elements of one dtype, tensor i at element `offsets[i]`.
    `names`, `dtypes` (one per tensor, all equal), `shapes` and `weight_version` are SGLang's field names."""

    index: int
    weight_version: int
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    is_last: bool = False
    error: str | None = None  # set when the sender aborts the transfer; no data follows
    hold: bool = False  # the receivers wait for the sender's commit before they return the transfer (`DistSender`)

    def to_bytes(self) -> bytes:
        # a shallow dict: `asdict` deep-copies every list, and this runs before the first bucket can leave
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> BucketMeta:
        return cls(**json.loads(data))


def buckets(named_tensors: NamedTensors, bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Group by dtype, in arrival order, into buckets of at most `bucket_bytes` (a bigger tensor travels alone).
    Yields each bucket as soon as it is full, the partly filled ones at the end."""
    filling: dict[torch.dtype, list[tuple[str, Tensor]]] = {}
    filled_bytes: dict[torch.dtype, int] = {}
    for name, tensor in validated(named_tensors):
        dtype, num_bytes = tensor.dtype, tensor.numel() * tensor.element_size()
        if filling.get(dtype) and filled_bytes[dtype] + num_bytes > bucket_bytes:
            yield filling.pop(dtype)
        if dtype not in filling:
            filling[dtype], filled_bytes[dtype] = [], 0
        filling[dtype].append((name, tensor))
        filled_bytes[dtype] += num_bytes
    yield from filling.values()


def mark_last(buckets: Iterator[list]) -> Iterator[tuple[list, bool]]:
    """(bucket, is_last) pairs; one empty bucket when there are none, so a receiver still learns the version."""
    previous = None
    for bucket in buckets:
        if previous is not None:
            yield previous, False
        previous = bucket
    yield (previous if previous is not None else []), True


def flatten(bucket: list[tuple[str, Tensor]], meta: BucketMeta, device: torch.device) -> Tensor:
    """Fill `meta` and return the bucket's flat tensor flat_N (a copy on `device`)."""
    for name, tensor in bucket:
        meta.names.append(name)
        meta.dtypes.append(str(tensor.dtype).removeprefix("torch."))
        meta.shapes.append(list(tensor.shape))
        meta.offsets.append(meta.numel)
        meta.numel += tensor.numel()
    if not bucket:
        return torch.empty(0, dtype=torch.uint8, device=device)
    with torch.no_grad():  # rather than a detach per tensor; and a move only where one is needed
        flat = [tensor.reshape(-1) for _, tensor in bucket]
        if {t.device for t in flat} != {device}:
            flat = [t.to(device) for t in flat]
        return torch.cat(flat)


def back_to_back(meta: BucketMeta) -> bool:
    """Whether the bucket's tensors fill it back to back in their order (what `FlatTensors` reads)."""
    if not len(meta.names) == len(meta.shapes) == len(meta.offsets):
        return False
    end = 0
    for shape, offset in zip(meta.shapes, meta.offsets, strict=True):
        if offset != end:
            return False
        end += math.prod(shape)
    return end == meta.numel


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TransportError(f"weights: unknown dtype {name!r} in bucket metadata", ranks=(0,))
    return dtype
