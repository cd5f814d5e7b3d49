"""The staged copies' halves (`engine.host_cache_copy: staged`, a CPU pool's always, or `staged_kernels`): a backup
gathers its pool pages into device staging and crosses the bus from there, one `copy_` per run of consecutive host
pages; a load crosses into staging and is scattered into the pool. With `staged_kernels` (`moves`) each half is one
`move_pages` launch instead (the gather, the crossing, the scatter from each staging tensor). `HostTier` issues
them where its placement says (the works tier_gather, tier_backup, tier_load, tier_join, tier_prefetch) and keeps
their ordering rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.engine.host_tier import CopyOp


class StagedHalves:
    """Mixed into `HostTier`: reads its pool by page (`_k`, `_v`, `_routing`), its host pages (`kv`, `routing`),
    and keeps its flush clock and transfer count. (`_staging` serves direct prefetches too.)"""

    def _index(self, pages: list[int]) -> torch.Tensor:
        """`pages` as a long tensor on the pool's device, uploaded from pinned memory (pageable memory would sync
        the stream)."""
        if not self.cuda:
            return torch.tensor(pages, dtype=torch.long)
        return torch.tensor(pages, dtype=torch.long, pin_memory=True).to(self._k.device, non_blocking=True)

    def _staging(self, n: int) -> tuple:
        kv = torch.empty((n, *self.kv.shape[1:]), dtype=self.kv.dtype, device=self._k.device)
        routing = None if self.routing is None else torch.empty(
            (n, *self.routing.shape[1:]), dtype=self.routing.dtype, device=self._k.device)
        return kv, routing

    def _gather(self, device_pages: list[int], t: tuple[float, float]) -> tuple[tuple, tuple[float, float]]:
        """Staging [n, 2, L, P, K, D] (and routing) holding the pool pages, read on the current stream: one
        indexed copy per tensor, straight into the staging (or one launch). (`t`: where the flush's clock is.)"""
        if self.moves is not None:
            staged = self._staging(len(device_pages))
            t = self.flush_clock.lap("staging", t)
            self.moves.move(self.moves.pool, self.moves.staging(staged), device_pages, list(range(len(device_pages))))
            return staged, self.flush_clock.lap("gather", t)
        idx = self._index(device_pages)
        t = self.flush_clock.lap("index", t)
        kv, routing = self._staging(len(device_pages))
        t = self.flush_clock.lap("staging", t)
        torch.index_select(self._k, 0, idx, out=kv[:, 0])
        torch.index_select(self._v, 0, idx, out=kv[:, 1])
        if routing is not None:
            torch.index_select(self._routing, 0, idx, out=routing)
        return (kv, routing), self.flush_clock.lap("gather", t)

    def _to_host(self, op: CopyOp) -> None:
        if self.moves is not None:
            self.moves.move(self.moves.staging(op.staged), self.moves.host, list(range(len(op.host_pages))),
                            op.host_pages)
            self.num_transfers += 1
            return
        kv, routing = op.staged
        for i, h, n in _runs(op.host_pages):
            self.kv[h:h + n].copy_(kv[i:i + n], non_blocking=True)
            if routing is not None:
                self.routing[h:h + n].copy_(routing[i:i + n], non_blocking=True)
            self.num_transfers += 1

    def _from_host(self, op: CopyOp) -> None:
        """The host pages of the copy's own transfer (`own`) into its staging, in that order."""
        kv, routing = op.staged
        pages = op.host_pages if op.own is None else [op.host_pages[i] for i in op.own]
        if self.moves is not None:
            self.moves.move(self.moves.host, self.moves.staging(op.staged), pages, list(range(len(pages))))
            self.num_transfers += 1
            return
        for i, h, n in _runs(pages):
            kv[i:i + n].copy_(self.kv[h:h + n], non_blocking=True)
            if routing is not None:
                routing[i:i + n].copy_(self.routing[h:h + n], non_blocking=True)
            self.num_transfers += 1

    def _scatter(self, ops: list[CopyOp], staged: tuple) -> None:
        """The loads' pages into the pool (on the current stream: compute), one indexed copy per staging tensor
        they come from: `staged`, their own transfer's, and those of the prefetches and backups in flight they take
        pages from (a backup's gather ran earlier on this stream; a prefetch's transfer earlier on the tier stream,
        which the join waited for). Every index is uploaded at once; rows of another copy's staging that form a
        run are a view of it, others are selected first."""
        own = [op.device_pages[i] for op in ops for i in op.own]
        sources = {None: (staged, list(range(len(own))), own)}
        for op in ops:
            for i, src, j in op.from_staging:
                if src.prefetch:
                    self._await_transfer(src)
                rows, pages = sources.setdefault(id(src), (src.staged, [], []))[1:]
                rows.append(j)
                pages.append(op.device_pages[i])
        sources = [s for s in sources.values() if s[2]]
        if self.moves is not None:  # one launch a staging tensor, rows by index
            for staged_, rows, pages in sources:
                self.moves.move(self.moves.staging(staged_), self.moves.pool, rows, pages)
            return
        flat = [p for _, _, pages in sources for p in pages]
        picks = [rows for _, rows, _ in sources if not _is_run(rows)]
        idx = self._index(flat + [j for rows in picks for j in rows])
        at, picked = 0, len(flat)
        for (kv, routing), rows, pages in sources:
            dst = idx[at:at + len(pages)]
            at += len(pages)
            if _is_run(rows):
                run = slice(rows[0], rows[0] + len(rows))
                kv, routing = kv[run], None if routing is None else routing[run]
            else:
                take = idx[picked:picked + len(rows)]
                picked += len(rows)
                kv, routing = kv.index_select(0, take), None if routing is None else routing.index_select(0, take)
            self._k[dst] = kv[:, 0]
            self._v[dst] = kv[:, 1]
            if routing is not None:
                self._routing[dst] = routing


def _is_run(rows: list[int]) -> bool:
    """Whether `rows` are consecutive ascending indices."""
    return rows == list(range(rows[0], rows[0] + len(rows)))


def _runs(pages: list[int]):
    """(index in `pages`, first page, length) of each run of consecutive page ids."""
    start = 0
    for i in range(1, len(pages) + 1):
        if i == len(pages) or pages[i] != pages[i - 1] + 1:
            yield start, pages[start], i - start
            start = i
