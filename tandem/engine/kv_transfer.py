"""KV pages between a prefill server and a decode server (prefill/decode disaggregation).

A prefill server computes a prompt's KV and its first token; the decode server takes the KV of the positions it
does not hold yet and decodes from there. What moves is a `KVPages`: the keys and values of token positions
[start, end) of one sequence, every layer, with a checksum per page computed where they were read (`page_sums`:
integer sums on the device that holds them, one host sync for all pages), so the receiver can prove, on its own
device, that it writes what the sender read. It moves in one of three ways (the servers choose:
`tandem.server.disagg`):

- bytes, between any two processes: `to_bytes` / `from_bytes` (safetensors: dtype and shapes travel with the data).
  The receiver owns what it parsed.
- by reference, between processes of one host: the sender's pool mapped once by the receiver, pages pinned
  (`tandem.engine.kv_mapped`: no copy on either side but the receiver's one pass into its pool; not a `KVPages`).
- point to point, between two processes of a torch.distributed group of their own (gloo on CPUs, NCCL between
  GPUs): `tandem.engine.kv_p2p`.

Bytes and point to point: the receiver verifies the checksums of what it holds (`verify`, on its device) before
it writes anything; by reference, as it writes (what fails is freed, never seen).
No cryptographic hash: the checksums guard against accidents (memory freed and reused, a copy gone wrong), not
against a sender that lies, and the servers trust each other as they trust their router; bytes that cross hosts
are carried by TCP, whose own checksums and this one's both apply.

`read_pages` and `write_pages` are the two ends in a KV pool: a gather and a scatter by index on the pool's device.
Both run in the engine's thread, between steps, so no page is freed or reused while its content is on the way in
or out: `read_pages` copies the pages before the request that holds them lets them go, and what a transfer holds
in flight is that copy, never the pool's pages; `write_pages` writes pages the engine gave the import, from a copy
the receiver owns.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from tandem.engine.kv_pool import KVPool
from tandem.engine.kv_shared import _unb64, sharing_domain, transfer_stream, why_not_shared

__all__ = ["KVPages", "TransferClock", "checksum_weights", "page_checksums", "page_sums",
           "read_pages", "sharing_domain", "transfer_stream", "why_not_shared", "wire_meta", "write_pages"]


@dataclass(frozen=True)
class KVPages:
    """Keys and values [L, end - start, K, D] of positions [start, end); `checksums`: one per page of `page_size`
    positions from `start` (page-aligned), over both tensors' bits (`page_checksums`). `routing`: the positions'
    routed experts [end - start, layers, k] int16 on the host, where the sender's pool keeps them
    (`KVPool.routing`; small, so it always travels in the message itself). Immutable: `verify` checks once."""

    start: int
    k: torch.Tensor
    v: torch.Tensor
    page_size: int
    checksums: tuple[str, ...]
    routing: torch.Tensor | None = None
    read_s: float = field(default=0.0, compare=False)
    clock: TransferClock | None = field(default=None, compare=False, repr=False)
    _verified: bool = field(default=False, init=False, repr=False, compare=False)

    @property
    def end(self) -> int:
        return self.start + self.k.shape[1]

    def to_bytes(self) -> bytes:
        k, v = self.k.cpu(), self.v.cpu()
        meta = {"start": str(self.start), "page_size": str(self.page_size), "checksums": json.dumps(self.checksums)}
        routing = {} if self.routing is None else {"routing": self.routing.contiguous()}
        return save_tensors({"k": k.contiguous(), "v": v.contiguous(), **routing}, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes, meta: dict) -> KVPages:
        """The inverse of `to_bytes`, with the metadata `meta` (see `wire_meta`); ValueError if it does not parse."""
        try:
            tensors = load_tensors(data)
            return cls(int(meta["start"]), tensors["k"], tensors["v"], int(meta["page_size"]),
                       tuple(json.loads(meta["checksums"])), tensors.get("routing"))
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"kv transfer: the payload does not parse ({e})") from e

    @classmethod
    def from_header(cls, header: dict, k: torch.Tensor, v: torch.Tensor) -> KVPages:
        """Keys `k` and values `v` with what `kv_shared.kv_header` says of them (not verified yet); KeyError,
        ValueError or TypeError if the header does not parse."""
        routing = None
        if (shared := header.get("routing")) is not None:
            routing = torch.frombuffer(bytearray(_unb64(shared["data"])), dtype=torch.int16).view(shared["shape"])
        return cls(int(header["start"]), k, v, int(header["page_size"]), tuple(map(str, header["checksums"])),
                   routing)

    def stacked(self) -> torch.Tensor:
        """Keys and values as one contiguous tensor [2, L, T, K, D]: without a copy where they are the halves of
        one (as `read_pages` gives them)."""
        k, v = self.k, self.v
        if k.is_contiguous() and v.is_contiguous() and k.untyped_storage().data_ptr() == \
                v.untyped_storage().data_ptr() and v.data_ptr() == k.data_ptr() + k.numel() * k.element_size():
            return k.as_strided((2, *k.shape), (k.numel(), *k.stride()))
        return torch.stack([k, v])

    def to(self, device: torch.device | str) -> KVPages:
        """This KV on `device` (itself if it is there already; a copy is not verified yet)."""
        if self.k.device == torch.device(device):
            return self
        with transfer_stream(device) as stream:
            kv_2LTKD = torch.empty((2, *self.k.shape), dtype=self.k.dtype, device=device)
            kv_2LTKD[0].copy_(self.k)
            kv_2LTKD[1].copy_(self.v)
            if stream is not None:
                stream.synchronize()
        return dataclasses.replace(self, k=kv_2LTKD[0], v=kv_2LTKD[1])

    def with_clock(self, clock: TransferClock) -> KVPages:
        """This KV timed by `clock` (`write_pages` marks it); verified if this is."""
        timed = dataclasses.replace(self, clock=clock)
        object.__setattr__(timed, "_verified", self._verified)
        return timed

    def write_into(self, pool: KVPool, pages: list[int]) -> None:
        """`write_pages(pool, pages, self)` (what an engine calls on any import: `kv_mapped.MappedKV` too)."""
        write_pages(pool, pages, self)

    def settle(self) -> None:
        """Nothing: this KV is the receiver's own (a `kv_mapped.MappedKV` tells its server it may release)."""

    def verify(self) -> None:
        """Raise ValueError naming the first page whose checksum differs from the sender's. The checksums run on the
        current stream (a receiver whose KV is complete may enter `transfer_stream` first)."""
        if self._verified:
            return
        mine = page_checksums(self.k, self.v, self.page_size)
        if len(mine) != len(self.checksums):
            raise ValueError(f"kv transfer: {len(mine)} pages arrived, the sender sent {len(self.checksums)}")
        for i, (a, b) in enumerate(zip(mine, self.checksums, strict=True)):
            if a != b:
                raise ValueError(f"kv transfer: page {i} (positions {self.start + i * self.page_size}...) arrived "
                                 "with another checksum than it left with")
        object.__setattr__(self, "_verified", True)


def wire_meta(data: bytes) -> dict:
    """The metadata of `KVPages.to_bytes`'s output (safetensors' header)."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + size]).get("__metadata__", {})


MASK = (1 << 64) - 1


def page_sums(k: torch.Tensor, v: torch.Tensor, page_size: int) -> torch.Tensor:
    """The page checksums of keys and values [L, T, K, D] as integers [pages, 2] (int64) on their device, with no
    host sync: per page of `page_size` positions (the last may be short), a row part and a column part. The KV's
    bytes are read as 32-bit words (int32; int16 or bytes widened to int32 where a position's bytes in a layer do
    not divide into 4), each (tensor, layer, position) a row of M words. Row part: each row's words summed modulo
    2**32, times an odd weight of (tensor, layer, offset in the page), summed modulo 2**64. Column part: each
    column's words summed over the page's positions, times an odd weight of (tensor, layer, column), all modulo
    2**32. Integer arithmetic with wrap-around, so every device, layout and order of summation gives the same value
    for the same bytes; the sums over the KV stay in int32 (a reduction of the KV's own type reads it at memory
    speed on a CPU too, where a widening one does not). A changed word changes its row's sum (by a difference
    below 2**32, not 0 modulo 2**32), so the row part (an odd weight times it is not 0 modulo 2**64); positions
    swapped within a page change the row part unless their rows sum alike; words swapped within a row change the
    column part but for rare differences; a page moved to another index carries its checksum with it, which the
    sender's for that index then lacks. Against accidents (memory reused, a copy gone wrong), not adversaries: a
    change that keeps every row and column sum of a page passes. Two reductions of the KV, for all pages at once."""
    if k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"kv: keys {tuple(k.shape)} and values {tuple(v.shape)} must both be [L, T, K, D]")
    layers, n = k.shape[:2]
    num_pages, full = -(-n // page_size), n // page_size * page_size
    rows_part = torch.zeros(num_pages, dtype=torch.int64, device=k.device)
    cols_part = torch.zeros(num_pages, dtype=torch.int32, device=k.device)
    for which, x in enumerate((k, v)):
        words_LTM = _words(x)
        row_w_LO, col_w_LM = checksum_weights(which, layers, page_size, words_LTM.shape[2], k.device)
        col_w_LM = col_w_LM.to(torch.int32)
        if full:
            body_LPOM = words_LTM[:, :full].view(layers, full // page_size, page_size, -1)
            rows_LPO = body_LPOM.sum(3, dtype=torch.int32).long()
            rows_part[:full // page_size] += (rows_LPO * row_w_LO[:, None, :]).sum((0, 2))
            cols_LPM = body_LPOM.sum(2, dtype=torch.int32)
            cols_part[:full // page_size] += (cols_LPM * col_w_LM[:, None, :]).sum((0, 2), dtype=torch.int32)
        if full < n:  # the last page, short
            tail_LTM = words_LTM[:, full:]
            rows_part[-1] += (tail_LTM.sum(2, dtype=torch.int32).long() * row_w_LO[:, :n - full]).sum()
            cols_part[-1] += (tail_LTM.sum(1, dtype=torch.int32) * col_w_LM).sum(dtype=torch.int32)
    return torch.stack([rows_part, cols_part.long()], dim=1)


def page_checksums(k: torch.Tensor, v: torch.Tensor, page_size: int) -> tuple[str, ...]:
    """`page_sums` as 24 hex digits a page (row part, column part): one host sync for all pages."""
    return tuple(_hex(pair) for pair in page_sums(k, v, page_size).tolist())


def _hex(pair: list[int]) -> str:
    return f"{pair[0] & MASK:016x}{pair[1] & 0xFFFFFFFF:08x}"


def checksum_weights(which: int, layers: int, page_size: int, words: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`page_sums`'s odd weights of keys (`which` 0) or values (1): per (layer, offset in the page) [L, page_size]
    and per (layer, column of 32-bit words) [L, words], int64 on `device`."""
    rows = _odd_weights(layers * page_size, 0x9E3779B1, which * layers * page_size, device).view(layers, page_size)
    return rows, _odd_weights(layers * words, 0x85EBCA77, which * (1 << 24), device).view(layers, words)


def _odd_weights(n: int, multiplier: int, offset: int, device: torch.device) -> torch.Tensor:
    """Odd weights below 2**31 (so int32 holds them), int64."""
    return (torch.arange(offset, offset + n, device=device) * multiplier) % (1 << 30) * 2 + 1


def _words(x_LTKD: torch.Tensor) -> torch.Tensor:
    """The bytes of each (layer, position) of `x_LTKD` as int32 words [L, T, M]: its own bytes where they divide
    into 4 (a copy only if the positions' bytes are not laid out so), else its int16 or byte words widened."""
    layers, n = x_LTKD.shape[:2]
    rows = x_LTKD.reshape(layers, n, math.prod(x_LTKD.shape[2:]))
    nbytes = rows.shape[2] * rows.element_size()
    word = next(w for w in (torch.int32, torch.int16, torch.uint8) if nbytes % w.itemsize == 0)
    try:
        words = rows.view(word)
    except RuntimeError:  # (strides or offset that do not divide into words)
        words = rows.contiguous().view(word)
    return words if word == torch.int32 else words.to(torch.int32)


def read_pages(pool: KVPool, pages: list[int], start: int, end: int,
               device: torch.device | str = "cpu") -> KVPages:
    """A copy on `device` of positions [start, end) of a sequence with page table `pages` (`start` page-aligned):
    keys and values gathered by index on the pool's device into one buffer [2, L, T, K, D] (then moved to `device`
    if it is another), their checksums computed there (one host sync). On the pool's own device for a transfer by
    reference or point to point; on the host for bytes. `read_s`: the time this took, device-synchronised."""
    assert start % pool.page_size == 0, start
    began = time.perf_counter()
    slots = pool.slots(pages, start, end)
    layers, _, heads, dim = pool.k_cache.shape
    kv_2LTKD = torch.empty((2, layers, end - start, heads, dim), dtype=pool.k_cache.dtype,
                           device=pool.k_cache.device)
    torch.index_select(pool.k_cache, 1, slots, out=kv_2LTKD[0])
    torch.index_select(pool.v_cache, 1, slots, out=kv_2LTKD[1])
    kv_2LTKD = kv_2LTKD.to(device)
    routing = None if pool.routing is None else pool.routing[slots].cpu()
    checksums = page_checksums(kv_2LTKD[0], kv_2LTKD[1], pool.page_size)  # (the host waits: the copy is done)
    return KVPages(start, kv_2LTKD[0], kv_2LTKD[1], pool.page_size, checksums, routing,
                   read_s=time.perf_counter() - began)


def write_pages(pool: KVPool, pages: list[int], kv: KVPages) -> None:
    """Write `kv` into positions [kv.start, kv.end) of a sequence with page table `pages` (its routing too, where
    the pool keeps it: ValueError if the pool keeps it and `kv` lacks it): scattered by index on the pool's device,
    the host not waiting. `kv.clock`, if any, is marked "write" before and "written" after."""
    slots = pool.slots(pages, kv.start, kv.end)
    if pool.routing is not None and kv.routing is None:
        raise ValueError("kv: the sender kept no routing, which this pool keeps (enable_return_routed_experts)")
    if kv.clock is not None:
        kv.clock.mark("write")
    if kv.k.device.type == "cuda":  # (made on another stream, perhaps: not reused before this stream has read it)
        kv.k.record_stream(torch.cuda.current_stream(kv.k.device))
        kv.v.record_stream(torch.cuda.current_stream(kv.v.device))
    pool.mark_unsummed(pages[kv.start // pool.page_size:-(-kv.end // pool.page_size)])
    pool.k_cache.index_copy_(1, slots, kv.k.to(pool.k_cache.device, pool.k_cache.dtype))
    pool.v_cache.index_copy_(1, slots, kv.v.to(pool.v_cache.device, pool.v_cache.dtype))
    if pool.routing is not None:
        pool.routing[slots] = kv.routing.to(pool.routing.device)
    if kv.clock is not None:
        kv.clock.mark("written")


class TransferClock:
    """Named points of one transfer on its receiver, for timing it without making the engine wait: each `mark` takes
    the host's time and, on a GPU, records an event on the current stream. `seconds(a, b)` once `b` has been
    reached (it waits for `b`'s event): on a GPU the device time between the two events, else host time. `mono`:
    each mark's `time.monotonic()`, one clock for all the host's processes."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.host: dict[str, float] = {}
        self.mono: dict[str, float] = {}
        self._events: dict[str, torch.cuda.Event] = {}

    def mark(self, name: str, device: bool = True) -> None:
        """`device=False`: the host's time alone (a point no device time is measured from or to)."""
        self.host[name], self.mono[name] = time.perf_counter(), time.monotonic()
        if device and self.device.type == "cuda":
            event = self._events[name] = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))

    def parts(self, names: tuple[str, ...]) -> dict[str, float]:
        """The host's time between consecutive marks of `names` that were made (others skipped), each keyed by the
        later mark's name + "_s"."""
        at = [(name, self.host[name]) for name in names if name in self.host]
        return {f"{b}_s": tb - ta for (_, ta), (b, tb) in zip(at, at[1:], strict=False)}

    def seconds(self, a: str, b: str) -> float:
        if self.device.type != "cuda":
            return self.host[b] - self.host[a]
        self._events[b].synchronize()
        return self._events[a].elapsed_time(self._events[b]) / 1e3
