"""Page checksums of KV pages by page index, on the device that holds them (`kv_transfer.page_sums`'s definition):
a pass over the pages (`page_sums_by_index`: the Triton kernel of `tandem.kernels.kv_copy` on a GPU, which can
copy them into another pool's pages in the same pass; torch elsewhere), or the records a prefill server's forward
kept (`record_sums_by_index`: `KVPool(slot_sums=True)`, `tandem.kernels.kv_sums`); the page index staged in a kept
page-locked buffer, which the kernels read in place, the sums read back through one (`host_sums`). Used by the KV
transfer by reference (`kv_mapped`).
"""

from __future__ import annotations

import array
import functools
from collections.abc import Callable

import numpy as np
import torch

from tandem.engine.kv_pool import records_page_sums
from tandem.engine.kv_shared import staging
from tandem.engine.kv_transfer import TransferClock, checksum_weights, page_sums

__all__ = ["HostRead", "canonical", "host_sums", "kernel_pass", "page_sums_by_index", "record_sums_by_index"]


@functools.lru_cache(maxsize=16)
def _weights(layers: int, page_size: int, words: int, device: torch.device):
    """`checksum_weights` of keys and values, made once per shape and device."""
    return tuple(checksum_weights(which, layers, page_size, words, device) for which in (0, 1))


def _words_per_position(cache: torch.Tensor) -> int:
    """32-bit words a position of one layer of pool tensor `cache` [L, S, K, D] holds (`kv_transfer._words` widens
    int16 or bytes where they do not divide into 4)."""
    nbytes = cache.shape[2] * cache.shape[3] * cache.element_size()
    return next(nbytes // w for w in (4, 2, 1) if nbytes % w == 0)


def _kernel_ok(*caches: torch.Tensor) -> bool:
    """Whether the Triton kernel takes these pools (on one GPU, laid out in words)."""
    if not all(c.is_cuda and c.device == caches[0].device for c in caches):
        return False
    try:
        from tandem.kernels.kv_copy import supports
    except ImportError:  # (no Triton)
        return False
    return all(supports(c) for c in caches)


def page_sums_by_index(src_k: torch.Tensor, src_v: torch.Tensor, src_pages, start: int, end: int,
                       page_size: int, dst_k: torch.Tensor | None = None, dst_v: torch.Tensor | None = None,
                       dst_pages=None, clock: TransferClock | None = None, tile=None,
                       records: torch.Tensor | None = None, read: bool = False) -> torch.Tensor | HostRead:
    """The `page_sums` [pages, 2] (int64, on the pools' device, not synchronised; `canonical` of them once on the
    host: the kernel's column parts hold their value in the low 32 bits) of positions [start, end) (`start`
    page-aligned) of a sequence whose pages, from `start`'s on, are `src_pages` of pool tensors `src_k`, `src_v`
    [L, S, K, D]; with `dst_*`, those positions also written into pages `dst_pages` of those pool tensors, in the
    same pass (Triton on a GPU: one read, one write, two launches and one sum) or by a torch gather and scatter.
    Pages: lists or int32 numpy arrays. `clock`, if any, is marked "launch" once the inputs are on their way, just
    before the first kernel is launched (the device time from there is the pass's own), and on the host alone
    "staged" (the page index written where the kernels read it), "launched" (the kernels queued).
    `tile`: the kernel's (`kv_copy.Tile`; its default if None). `records`: the source pool's checksum records
    (`KVPool.sums`, or a mapping of it): then [2, pages, 2], the pass's sums and those the records give
    (`record_sums_by_index`, queued behind the pass, through the same staged index). `read`: the sums also queued
    for the host right behind the kernels, before anything else the host does, and returned as a `HostRead`."""
    num, n = len(src_pages), end - start
    if start % page_size or num != -(-n // page_size) or (dst_pages is not None and len(dst_pages) != num):
        raise ValueError(f"kv transfer: {num} pages (and {None if dst_pages is None else len(dst_pages)} to write) "
                         f"do not hold positions [{start}, {end}) in pages of {page_size}")
    caches = (src_k, src_v) + ((dst_k, dst_v) if dst_k is not None else ())
    device = src_k.device
    if _kernel_ok(*caches):
        index, staged = _stage_index(device, (src_pages, src_pages if dst_pages is None else dst_pages,
                                               _rows(num, n, page_size)), clock)
        if clock is not None:
            clock.mark("launch")
        parts = torch.empty((num, 2, src_k.shape[0], 2), dtype=torch.int64, device=device)  # page, k/v, layer
        sums = torch.empty((1 + (records is not None), num, 2), dtype=torch.int64, device=device)
        kernel_pass((src_k, src_v), (dst_k, dst_v), records, page_size, index, parts, sums, tile)
        out = sums if records is not None else sums[0]
        if read:  # (first: the host's work below then overlaps the kernels, not the wait after them)
            out = HostRead(out)
        staged()  # (after the launches: they read the index where it was staged)
        if clock is not None:
            clock.mark("launched", device=False)
        return out
    slots = _slots(src_pages, page_size, n, device)
    k, v = src_k.index_select(1, slots), src_v.index_select(1, slots)
    sums = page_sums(k, v, page_size)
    if dst_k is not None:
        dst_slots = _slots(dst_pages, page_size, n, dst_k.device)
        dst_k.index_copy_(1, dst_slots, k.to(dst_k.dtype))
        dst_v.index_copy_(1, dst_slots, v.to(dst_v.dtype))
    if records is not None:
        sums = torch.stack([sums, record_sums_by_index(records, src_pages, start, end, page_size)])
    return HostRead(sums) if read else sums


def kernel_pass(src: tuple[torch.Tensor, torch.Tensor], dst: tuple[torch.Tensor | None, torch.Tensor | None],
                records: torch.Tensor | None, page_size: int, index: torch.Tensor, parts: torch.Tensor,
                sums: torch.Tensor, tile=None) -> None:
    """`page_sums_by_index`'s pass on a GPU, queued on the current stream: the pages `index` [3, pages] names (int32:
    source pages, destination pages, rows each; page-locked host memory or the pools' device) checksummed from pool
    tensors `src` (keys, values) and, where `dst` holds pool tensors, written into them; the sums of what was read
    into `sums[0]` and, with `records`, the records' sums into `sums[1]` ([1 or 2, pages, 2] int64 on the device, as
    `page_sums_by_index` returns them); `parts` [pages, 2, L, 2] int64, the kernels' per-layer parts. Two launches of
    `kv_copy.copy_page_sums`, a sum, and `kv_sums.page_sums`. (`kv_pass_graph` captures it.)"""
    from tandem.kernels.kv_copy import copy_page_sums

    pages, layers = index.shape[1], src[0].shape[0]
    for which, (s, d) in enumerate(zip(src, dst, strict=True)):
        row_w, col_w = _weights(layers, page_size, _words_per_position(s), s.device)[which]
        copy_page_sums(s, index[0], index[2], page_size, row_w, col_w, d, index[1] if d is not None else None,
                       out=parts[:, which], tile=tile)
    torch.sum(parts.view(pages, 2 * layers, 2), 1, out=sums[0])
    if records is not None:
        from tandem.kernels import kv_sums

        kv_sums.page_sums(records, index[0], index[2], page_size, out=sums[1])


def record_sums_by_index(records: torch.Tensor, pages, start: int, end: int, page_size: int,
                         clock: TransferClock | None = None) -> torch.Tensor:
    """`page_sums_by_index`'s sums of positions [start, end) held in `pages` (from `start`'s on) of a pool whose
    checksum records are `records` (`KVPool.sums` [S, L, 2] or a mapping of it; the pages must be `summed`): one
    small kernel on a GPU (`tandem.kernels.kv_sums.page_sums`), else `kv_pool.records_page_sums`. Not
    synchronised; `clock` marked as by `page_sums_by_index`."""
    P, num, n = page_size, len(pages), end - start
    if not records.is_cuda:
        return records_page_sums(records, pages, start, end, P)
    from tandem.kernels import kv_sums

    index, staged = _stage_index(records.device, (pages, _rows(num, n, P)), clock)
    if clock is not None:
        clock.mark("launch")
    sums = kv_sums.page_sums(records, index[0], index[1], P)
    staged()
    if clock is not None:
        clock.mark("launched", device=False)
    return sums


def _rows(num: int, n: int, page_size: int) -> array.array:
    """The positions each of `num` pages holds of `n` (full pages, the last maybe short)."""
    rows = array.array("i", [page_size]) * num
    if num:
        rows[-1] = n - (num - 1) * page_size
    return rows


def _stage_index(device: torch.device, columns: tuple, clock: TransferClock | None) -> tuple[torch.Tensor, Callable]:
    """`columns` (int sequences of one length n) as one int32 tensor [len(columns), n] in a kept staging buffer
    (`Staging`), written through a numpy view: on a GPU page-locked host memory, which the kernels read in place over
    the bus (zero-copy, as `tandem.kernels.page_move`'s index: no upload, no device allocation that may synchronise
    the device). Returns it and `done()`, to call once its readers are queued: the buffer is handed out again only
    once the device is past them. Marks `clock` "staged" (host)."""
    num = len(columns[0])
    stage = staging(device)
    nbytes = 4 * len(columns) * num
    buf = stage.take(nbytes)
    host = buf.view(nbytes, torch.int32).view(len(columns), num)
    rows = host.numpy()
    for row, values in zip(rows, columns, strict=True):
        row[:] = values
    if clock is not None:
        clock.mark("staged", device=False)
    return host, lambda: stage.give(buf, buf.record(device))


def canonical(sums: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """Sums [..., pages, 2] as `page_sums` has them: the column parts' low 32 bits as a signed 32-bit value (the
    kernel's parts summed over layers keep higher bits too; `page_sums`'s are unchanged). A tensor or, quicker on
    the host, a numpy array (int64)."""
    cols = sums[..., 1] & 0xFFFFFFFF
    cols = (cols ^ 0x80000000) - 0x80000000
    return (np.stack if isinstance(sums, np.ndarray) else torch.stack)([sums[..., 0], cols], -1)


class HostRead:
    """Sums on their way to the host: on a GPU a copy into a kept page-locked buffer (`Staging`, not pageable
    memory), queued as this is made (right behind the kernels that compute them) with an event behind it; off a GPU
    the sums themselves. `result(clock)`: once, the host waits for them (`clock`, if any, marked "synced" as the
    wait returns) and has `canonical` of them (int64 numpy)."""

    def __init__(self, sums: torch.Tensor):
        self.sums, self.done = sums, None
        if sums.is_cuda:
            self.stage, nbytes = staging(sums.device), sums.numel() * 8
            self.buf = self.stage.take(nbytes)
            self.sums = self.buf.view(nbytes, torch.int64).view(sums.shape)
            self.sums.copy_(sums, non_blocking=True)
            self.done = self.buf.record(sums.device)

    def result(self, clock: TransferClock | None = None) -> np.ndarray:
        if self.done is not None:
            self.done.synchronize()
        if clock is not None:
            clock.mark("synced", device=False)
        out = canonical(self.sums.numpy())  # (a new array: the buffer may be handed out again)
        if self.done is not None:
            self.stage.give(self.buf, self.done)
            self.done = None
        return out


def host_sums(sums: torch.Tensor, clock: TransferClock | None = None) -> np.ndarray:
    """`canonical` of `page_sums_by_index`'s sums, on the host (int64 numpy [pages, 2]), the host waiting for them
    (`HostRead`; `clock` marked "synced" as the wait returns)."""
    return HostRead(sums).result(clock)


def _slots(pages: list[int], page_size: int, n: int, device: torch.device) -> torch.Tensor:
    """The slots of the first `n` positions held by `pages` in order."""
    pos = torch.arange(n)
    return (torch.tensor(pages, dtype=torch.long)[pos // page_size] * page_size + pos % page_size).to(device)
