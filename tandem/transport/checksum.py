"""A checksum of named weights, computed where they are (a GPU sums its own memory; nothing but one number per
tensor is copied to the host, in one transfer per device). A tensor's bytes as words (int32, or int16 when its size
is not a multiple of 4 bytes), laid out in rows of `ROW_WORDS`: its column sums times odd weights of the columns plus
its row sums times odd weights of the rows, times an odd weight of the tensor's name. Integer arithmetic modulo
2**64, so every device and every replica gives the same value for the same bytes (however the sums are grouped); a
changed word changes it, and so does a word moved to another row or column, or a tensor under another name.
Replicas compare theirs after every weight update."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

ROW_WORDS = 64
MASK = (1 << 64) - 1


def _odd_weights(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device) * 0x9E3779B1 % (1 << 31) * 2 + 1


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as words in rows of `ROW_WORDS` [R, ROW_WORDS] (a view where no padding is needed)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else torch.nn.functional.pad(
        raw, (0, raw.numel() % 2)).view(torch.int16)
    if words.numel() % ROW_WORDS:
        words = torch.nn.functional.pad(words, (0, -words.numel() % ROW_WORDS))
    return words.view(-1, ROW_WORDS)


def _name_weight(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") | 1


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """16 hex digits over every (name, tensor) pair, in any order. Tensors of one device, word type and size are
    summed together (a few kernels per group, not per tensor); the host waits once per device."""
    groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    with torch.no_grad():
        for name, tensor in named_tensors:
            rows = _rows(tensor)
            groups.setdefault((rows.device, rows.dtype, rows.shape[0]), []).append((name, rows))
        names: dict[torch.device, list[str]] = {}
        sums: dict[torch.device, list[torch.Tensor]] = {}
        for (device, _, num_rows), members in groups.items():
            rows_GRC = torch.stack([rows for _, rows in members]) if len(members) > 1 else members[0][1][None]
            cols = (rows_GRC.sum(1, dtype=torch.int64) * _odd_weights(ROW_WORDS, device)).sum(1)
            by_row = (rows_GRC.sum(2, dtype=torch.int64) * _odd_weights(num_rows, device)).sum(1)
            names.setdefault(device, []).extend(name for name, _ in members)
            sums.setdefault(device, []).append(cols + by_row)
        total = 0
        for device, parts in sums.items():
            for name, value in zip(names[device], torch.cat(parts).tolist(), strict=True):
                total = (total + (value & MASK) * _name_weight(name)) & MASK
    return f"{total:016x}"
