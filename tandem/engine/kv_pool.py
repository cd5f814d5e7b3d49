"""The paged KV pool: key/value tensors for a fixed number of pages, and a reference-counted page allocator.

A page holds `page_size` consecutive token positions of one sequence for every layer. Slot
`page * page_size + offset` indexes the slot-major views `k_cache` / `v_cache` [L, S, K, D].
Whoever uses a page holds a reference (a request's page table, the prefix cache); a page returns to the
free list when its last reference is dropped.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import uuid

import numpy as np
import torch

from tandem.config import EngineConfig, ModelConfig

log = logging.getLogger(__name__)


class PageAllocator:
    """Reference-counted page ids 0..num_pages-1 (the storage, if any, belongs to the subclass)."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.refcount = [0] * num_pages
        # decrefs that left a page with one reference or none: the only way a page becomes free or evictable (held
        # by the cache alone), so while it stands still an eviction that ran out of pages would find none again
        self.releases = 0
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low page ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n fresh pages with one reference each, or None (and nothing allocated) if fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcount[p] > 0, f"incref of free page {p}"
            self.refcount[p] += 1

    def decref(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcount[p] > 0, f"decref of free page {p}"
            self.refcount[p] -= 1
            if self.refcount[p] <= 1:
                self.releases += 1
                if self.refcount[p] == 0:
                    self._free.append(p)


class KVPool(PageAllocator):
    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device,
                 num_kv_heads: int | None = None, routing: bool = False, shared: bool = False,
                 slot_sums: bool = False):
        """`num_kv_heads`: the KV heads this rank holds (fewer than the model's under tensor parallelism).
        `routing`: also keep, slot by slot beside the KV, the top-k expert ids every layer of a mixture-of-experts
        model routed the slot's token to (`routing` [S, num_hidden_layers, num_experts_per_tok] int16; -1 where a
        layer is dense or nothing was written). `shared` (a prefill server's pool on a CPU): keys and values in one
        shared-memory file that other processes of the host map by `shm_path` (`kv_mapped`); on a GPU the pool is
        mapped by CUDA IPC and this changes nothing. `share_id`: this pool's identity, for whoever maps it.
        `slot_sums` (a prefill server's pool): also keep, slot by slot, each layer's share of its page's checksum
        (`kv_transfer.page_sums`) as the forward wrote it (`sums` [S, L, 2] int64, stored by `record_sums`; in the
        shared-memory file after the KV where `shared`), so that `records_page_sums` gives an export's checksums
        without a pass over its KV; `summed` [num_pages] (on the host) says which pages hold only positions the
        forward wrote since the page was handed out (a page filled another way, loaded from the host tier or
        imported, is marked by `mark_unsummed`, and recorded by `record_pages` before it is exported); and
        `epochs` [num_pages] int64, each page's count of times handed out (`alloc`), in a shared-memory file of
        its own (`epochs_path`; None where /dev/shm cannot hold it) which a decode server maps to see whether a
        page it read was handed out again meanwhile."""
        super().__init__(num_pages, page_size)
        # one extra page, never handed out: padding rows of fixed-shape decode batches write there
        self.scratch_slot = num_pages * page_size
        shape = (config.num_hidden_layers, (num_pages + 1) * page_size, num_kv_heads or config.num_key_value_heads,
                 config.head_dim)
        self.share_id, self.shm_path, self.epochs_path, self.epochs = uuid.uuid4().hex, None, None, None
        records_shape = (shape[1], shape[0], 2)
        kv_bytes = -(-2 * math.prod(shape) * dtype.itemsize // 64) * 64
        shm = _shared_memory(kv_bytes + slot_sums * 8 * math.prod(records_shape)) \
            if shared and torch.device(device).type == "cpu" else None
        self.sums = None
        if shm is not None:
            self.shm_path, raw = shm
            kv = raw[:2 * math.prod(shape) * dtype.itemsize].view(dtype).view(2, *shape)  # (zeros, as the file starts)
            self.k_cache, self.v_cache = kv[0], kv[1]
            if slot_sums:
                self.sums = raw[kv_bytes:].view(torch.int64).view(records_shape)
        else:
            self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.routing = torch.full((shape[1], config.num_hidden_layers, config.num_experts_per_tok), -1,
                                  dtype=torch.int16, device=device) if routing else None
        if slot_sums and self.sums is None:
            self.sums = torch.zeros(records_shape, dtype=torch.int64, device=device)
        self.summed = np.zeros(num_pages, dtype=bool) if slot_sums else None
        if slot_sums and (epochs := _shared_memory(8 * num_pages)) is not None:
            self.epochs_path, raw = epochs
            self.epochs = raw.view(torch.int64).numpy()

    def alloc(self, n: int) -> list[int] | None:
        pages = super().alloc(n)
        if pages and self.summed is not None:
            self.summed[pages] = True  # (what the forward writes into them is recorded as it is written)
            if self.epochs is not None:
                self.epochs[pages] += 1  # (before anything is written into them: see `kv_mapped.MappedKV.check`)
        return pages

    def mark_unsummed(self, pages: list[int]) -> None:
        """Pages whose KV was written other than by the forward: their `sums` records are not theirs."""
        if self.summed is not None:
            self.summed[pages] = False

    def record_sums(self, slots: torch.Tensor) -> None:
        """Record every layer's checksum shares of the keys and values just written at `slots` (into `sums`; one
        launch, asynchronous, on a GPU). Called by the model after each forward (`Qwen3ForCausalLM.capture_kv_sums`)."""
        from tandem.engine.kv_index_sums import _weights, _words_per_position

        k, v = self.k_cache, self.v_cache
        (row_k, col_k), (row_v, col_v) = _weights(k.shape[0], self.page_size, _words_per_position(k), k.device)
        if k.is_cuda:
            from tandem.kernels.kv_sums import record_slot_sums, supports

            if supports(k) and supports(v):
                record_slot_sums(k, v, slots, self.sums, (row_k, col_k, row_v, col_v), self.page_size)
                return
        from tandem.engine.kv_transfer import _words

        slots = slots.long()
        offsets = slots % self.page_size
        for layer in range(k.shape[0]):
            row_part = torch.zeros(slots.numel(), dtype=torch.int64, device=slots.device)
            col_part = torch.zeros(slots.numel(), dtype=torch.int32, device=slots.device)
            for cache, row_w, col_w in ((k[layer], row_k[layer], col_k[layer]), (v[layer], row_v[layer], col_v[layer])):
                words_TM = _words(cache.index_select(0, slots)[None])[0]
                row_part += words_TM.sum(1, dtype=torch.int32).long() * row_w[offsets]
                col_part += (words_TM * col_w.to(torch.int32)).sum(1, dtype=torch.int32)
            self.sums[slots, layer] = torch.stack([row_part, col_part.long()], 1)

    def record_pages(self, pages: list[int]) -> torch.cuda.Event | None:
        """Record the checksum shares of every position of `pages` that are not `summed` (their KV written other
        than by the forward: loaded from the host tier, imported), from what they hold now; then they are. Call in
        the engine's thread, after whatever wrote them was queued (on the current stream). Returns, on a GPU where
        it queued any, an event behind them: another process reading the records must wait for it (the stream
        may hold the next step ahead of them); else None (done)."""
        held = np.asarray(pages, dtype=np.int64)
        if not (stale := held[~self.summed[held]]).size:
            return None
        P = self.page_size
        slots = (torch.from_numpy(stale)[:, None] * P + torch.arange(P)).flatten()
        if self.k_cache.is_cuda:  # (a copy from pageable memory would wait for the stream: the step in flight)
            slots = slots.pin_memory()
        self.record_sums(slots.to(self.k_cache.device, non_blocking=True))
        self.summed[stale] = True
        if not self.k_cache.is_cuda:
            return None
        recorded = torch.cuda.Event()
        recorded.record(torch.cuda.current_stream(self.k_cache.device))
        return recorded

    def copy_slots(self, src_page: int, dst_page: int, num_tokens: int) -> None:
        """Copy the first `num_tokens` positions of one page into another (all layers): how a request
        takes a partially matched cached page without writing into a page others read."""
        P = self.page_size
        src, dst = slice(src_page * P, src_page * P + num_tokens), slice(dst_page * P, dst_page * P + num_tokens)
        self.k_cache[:, dst] = self.k_cache[:, src]
        self.v_cache[:, dst] = self.v_cache[:, src]
        if self.routing is not None:
            self.routing[dst] = self.routing[src]
        if self.sums is not None:
            self.sums[dst] = self.sums[src]
            self.summed[dst_page] = self.summed[src_page]

    def read_routing(self, pages: list[int], end: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The routing of token positions [0, end) of a sequence with page table `pages`, on the host ([end,
        layers, k] int16), without waiting for the device's queued work: on CUDA a pinned tensor an asynchronous copy
        fills behind that work, to be read once the event returned has completed (None: ready now)."""
        slots = self.slots(pages, 0, end, device="cpu")
        if not self.routing.is_cuda:
            return self.routing[slots], None
        rows = self.routing[slots.pin_memory().to(self.routing.device, non_blocking=True)]
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True).copy_(rows, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.routing.device))
        return host, copied

    def slots(self, pages: list[int], start: int, end: int, device=None) -> torch.Tensor:
        """Slot indices of token positions [start, end) of a sequence with page table `pages`."""
        pos = torch.arange(start, end)
        table = torch.tensor(pages, dtype=torch.long)
        slots = table[pos // self.page_size] * self.page_size + pos % self.page_size
        return slots.to(device or self.k_cache.device, non_blocking=True)


def records_page_sums(records: torch.Tensor, pages, start: int, end: int, page_size: int) -> torch.Tensor:
    """`kv_transfer.page_sums` of token positions [start, end) (`start` page-aligned) held in `pages` (from
    `start`'s page on) of a pool whose checksum records are `records` (`KVPool.sums` [S, L, 2], or a mapping of
    it): [pages, 2] int64 on their device, not synchronised (the column parts hold their value in the low 32 bits:
    `kv_index_sums.canonical`). The torch way; `tandem.kernels.kv_sums.page_sums` is the GPU's."""
    P, n = page_size, end - start
    pos = torch.arange(n)
    table = torch.as_tensor(np.asarray(pages, dtype=np.int64))
    slots = (table[pos // P] * P + pos % P).to(records.device)
    shares = records[slots].sum(1)  # [n, 2]: the layers' shares, wrapping
    padded = torch.nn.functional.pad(shares, (0, 0, 0, -n % P))
    return padded.view(-1, P, 2).sum(1)


def _shared_memory(nbytes: int, what: str = "KV pool") -> tuple[str, torch.Tensor] | None:
    """`nbytes` zero bytes of shared memory, mapped here: a file in /dev/shm removed at once, which stays while this
    process holds it open (until it exits: nothing is left behind, even if it is killed). Other processes of the host
    map it by the path returned (this process's descriptor in /proc). None (logged) where /dev/shm cannot hold it:
    its space is reserved now, so a full /dev/shm fails here rather than as a bus error on a later write."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(directory, f"tandem-pool-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError) as e:
        os.close(fd)
        log.warning("%s: not in shared memory (%s: %s); a decode server takes its KV another way", what, directory, e)
        return None
    finally:
        os.unlink(path)
    return f"/proc/{os.getpid()}/fd/{fd}", raw


def plan_kv_pages(config: ModelConfig, engine_config: EngineConfig, dtype: torch.dtype) -> int:
    """Pages that fit in `kv_memory_fraction` of the GPU memory free after the weights (the rest is left for
    activations, CUDA graphs and the sampler)."""
    if not engine_config.device.startswith("cuda"):
        raise ValueError("engine config: num_pages 0 (size from free memory) needs a CUDA device")
    free, _ = torch.cuda.mem_get_info(torch.device(engine_config.device))
    per_page = (2 * config.num_hidden_layers * engine_config.page_size * config.num_key_value_heads
                * config.head_dim * dtype.itemsize)
    if engine_config.role == "prefill":  # (its checksum records: `KVPool(slot_sums=True)`)
        per_page += config.num_hidden_layers * engine_config.page_size * 2 * 8
    num_pages = int(free * engine_config.kv_memory_fraction) // per_page - 1  # minus the scratch page
    log.info("KV pool: %d pages of %d tokens (%.1f GiB of %.1f GiB free)", num_pages, engine_config.page_size,
             num_pages * per_page / 2**30, free / 2**30)
    return num_pages
