"""KV pages between a prefill server and a decode server (prefill/decode disaggregation).

A prefill server computes a prompt's KV and its first token; the decode server takes the KV of the positions it
does not hold yet and decodes from there. What moves is a `KVPages`: the keys and values of token positions
[start, end) of one sequence, every layer, with a checksum per page computed where they were read, so the receiver
can prove it writes what the sender read. `to_bytes` / `from_bytes` are its wire form between processes
(safetensors: dtype and shapes travel with the data); the transfer itself belongs to the servers
(`tandem.server.disagg`).

`read_pages` and `write_pages` are the two ends in a KV pool. Both run in the engine's thread, between steps, so no
page is freed or reused while its content is on the way in or out.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from tandem.engine.kv_pool import KVPool


@dataclass(frozen=True)
class KVPages:
    """Keys and values [L, end - start, K, D] of positions [start, end); `checksums`: one per page of `page_size`
    positions from `start` (page-aligned), over both tensors' bytes."""

    start: int
    k: torch.Tensor
    v: torch.Tensor
    page_size: int
    checksums: tuple[str, ...]

    @property
    def end(self) -> int:
        return self.start + self.k.shape[1]

    def to_bytes(self) -> bytes:
        meta = {"start": str(self.start), "page_size": str(self.page_size), "checksums": json.dumps(self.checksums)}
        return save_tensors({"k": self.k.contiguous(), "v": self.v.contiguous()}, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes, meta: dict) -> KVPages:
        """The inverse of `to_bytes`, with the metadata `meta` (see `wire_meta`); ValueError if it does not parse."""
        try:
            tensors = load_tensors(data)
            return cls(int(meta["start"]), tensors["k"], tensors["v"], int(meta["page_size"]),
                       tuple(json.loads(meta["checksums"])))
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"kv transfer: the payload does not parse ({e})") from e

    def verify(self) -> None:
        """Raise ValueError naming the first page whose checksum differs from the sender's."""
        mine = page_checksums(self.k, self.v, self.page_size)
        if len(mine) != len(self.checksums):
            raise ValueError(f"kv transfer: {len(mine)} pages arrived, the sender sent {len(self.checksums)}")
        for i, (a, b) in enumerate(zip(mine, self.checksums, strict=True)):
            if a != b:
                raise ValueError(f"kv transfer: page {i} (positions {self.start + i * self.page_size}...) arrived "
                                 "with another checksum than it left with")


def wire_meta(data: bytes) -> dict:
    """The metadata of `KVPages.to_bytes`'s output (safetensors' header)."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + size]).get("__metadata__", {})


def page_checksums(k: torch.Tensor, v: torch.Tensor, page_size: int) -> tuple[str, ...]:
    """A blake2b digest per page of positions (dimension 1), over the keys' and values' bytes."""
    out = []
    for s in range(0, k.shape[1], page_size):
        h = hashlib.blake2b(digest_size=8)
        for t in (k[:, s:s + page_size], v[:, s:s + page_size]):
            h.update(t.contiguous().cpu().view(torch.uint8).numpy().tobytes())
        out.append(h.hexdigest())
    return tuple(out)


def read_pages(pool: KVPool, pages: list[int], start: int, end: int) -> KVPages:
    """A copy of positions [start, end) of a sequence with page table `pages` (`start` page-aligned)."""
    assert start % pool.page_size == 0, start
    slots = pool.slots(pages, start, end)
    k, v = pool.k_cache[:, slots].cpu(), pool.v_cache[:, slots].cpu()
    return KVPages(start, k, v, pool.page_size, page_checksums(k, v, pool.page_size))


def write_pages(pool: KVPool, pages: list[int], kv: KVPages) -> None:
    """Write `kv` into positions [kv.start, kv.end) of a sequence with page table `pages`."""
    slots = pool.slots(pages, kv.start, kv.end)
    pool.k_cache[:, slots] = kv.k.to(pool.k_cache.device, pool.k_cache.dtype)
    pool.v_cache[:, slots] = kv.v.to(pool.v_cache.device, pool.v_cache.dtype)
