"""A checksum of named weights, computed where they are (a GPU sums its own memory in two passes; nothing is copied
to the host). A tensor's bytes as words (int32, or int16 when its size is not a multiple of 4 bytes), laid out in
rows of `ROW_WORDS`: its column sums times odd weights of the columns plus its row sums times odd weights of the
rows, times an odd weight of the tensor's name. Integer arithmetic modulo 2**64, so every device and every replica
gives the same value for the same bytes; a changed word changes it, and so does a word moved to another row or
column, or a tensor under another name. Replicas compare theirs after every weight update."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

ROW_WORDS = 64
MASK = (1 << 64) - 1


def _odd_weights(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device) * 0x9E3779B1 % (1 << 31) * 2 + 1


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """16 hex digits over every (name, tensor) pair, in any order."""
    total = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            words = raw.view(torch.int32) if raw.numel() % 4 == 0 else torch.nn.functional.pad(
                raw, (0, raw.numel() % 2)).view(torch.int16)
            rows = torch.nn.functional.pad(words, (0, -words.numel() % ROW_WORDS)).view(-1, ROW_WORDS)
            cols_sum = (rows.sum(0, dtype=torch.int64) * _odd_weights(ROW_WORDS, rows.device)).sum()
            rows_sum = (rows.sum(1, dtype=torch.int64) * _odd_weights(rows.shape[0], rows.device)).sum()
            tag = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") | 1
            total = (total + (int(cols_sum + rows_sum) & MASK) * tag) & MASK
    return f"{total:016x}"
