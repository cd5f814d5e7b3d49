"""The engine core's part in prefill/decode disaggregation (`tandem.engine.core` states it): the decode server's
end (`Probe`, `ImportRequest`: imports placed into fresh pages, held while paused, checked as written where they
come by reference) and the prefill server's pinned exports let go (`unpin`). A part of `EngineCore`, split out by
concept: its methods use the core's state and run in its thread, as every command does."""

from __future__ import annotations

import collections
import logging

from tandem.distributed.parallel import cdiv
from tandem.engine import commands
from tandem.engine.kv_mapped import MappedKV
from tandem.engine.kv_transfer import KVPages
from tandem.engine.request import Request
from tandem.engine.scheduler import PENDING
from tandem.types import HANDED_BACK, FinishReason

log = logging.getLogger("tandem.engine.core")


class DecodeImports:
    """`EngineCore`'s disaggregation methods (the core sets `_unpins`, `_held`, `_expected`)."""

    _unpins: collections.deque[list[int]]

    def unpin(self, pages: list[int]) -> None:
        """Drop the references a pinned export holds on `pages` (`kv_mapped.PinnedKV.free`). Thread-safe: the pages
        go back to the allocator before the next command is applied."""
        self._unpins.append(pages)

    def _probe(self, input_ids: list[int]) -> int:
        if self.cache is None:
            return 0
        pages = self.cache.match(input_ids).pages
        return next((i for i, page in enumerate(pages) if page is None), len(pages)) * self.pool.page_size

    def _import_request(self, cmd: commands.ImportRequest) -> None:
        kv, out = cmd.kv, cmd.output_ids
        n = len(cmd.input_ids) + len(out) - 1  # the positions with KV: all but the last token
        if cmd.rid in self._requests:
            raise ValueError(f"rid: {cmd.rid!r} is already in flight")
        if cmd.sampling.seed is None:
            raise ValueError("sampling_params.seed: an imported request needs the seed its tokens were sampled with")
        if not out or not len(out) == len(cmd.output_logprobs) == len(cmd.weight_versions):
            raise ValueError("output_ids: at least the token the prefill server sampled, with its logprob and version")
        if not isinstance(kv, KVPages | MappedKV) or kv.end != n or kv.start % self.pool.page_size:
            raise ValueError(f"kv: must hold positions [a page boundary, {n}) of the request")
        kv.verify()
        req = Request(cmd.rid, [*cmd.input_ids, *out[:-1], PENDING], len(cmd.input_ids), cmd.sampling,
                      cmd.sampling.seed, next(self._arrival))
        req.output_logprobs, req.weight_versions = list(cmd.output_logprobs[:-1]), list(cmd.weight_versions[:-1])
        req.return_routed_experts = cmd.return_routed_experts and self.pool.routing is not None
        reason = self.scheduler.resolve(req, n, out[-1], cmd.output_logprobs[-1], cmd.weight_versions[-1])
        if (aborted := self._expected.pop(cmd.rid, None)) is not None:  # aborted while the prefill server computed
            reason = FinishReason("abort", message=aborted)
        self._requests[cmd.rid] = req
        if reason is not None:  # the first token ended it, or an abort did
            kv.settle()
            self.scheduler.waiting.append(req)
            self._finish(req, reason)
        elif self.paused is not None:
            self._held.append((req, kv))
        else:
            self._place_import(req, kv)

    def _place_import(self, req: Request, kv: KVPages | MappedKV) -> None:
        """Give the request its prompt's pages: the cached ones before `kv.start` (shared), fresh ones holding the
        imported KV after it; then queue it. The request computes its prompt here instead, nothing written, if those
        cached pages are gone (evicted or flushed since the probe), no pages are free, or the KV was computed under
        other weights than this engine holds now (KV never mixes weight versions silently; its tokens keep the
        versions that sampled them). KV whose checksums fail as it is written (`MappedKV`) ends the request with an
        abort naming the page, its pages freed (nothing of it is seen). The import is settled either way."""
        try:
            self._place_import_kv(req, kv)
        finally:
            kv.settle()

    def _place_import_kv(self, req: Request, kv: KVPages | MappedKV) -> None:
        n, P = len(req.tokens) - 1, self.pool.page_size
        stale = req.weight_versions[-1] != self.weight_version
        if stale and self.config.role == "decode":
            self.scheduler.waiting.append(req)  # (a prefill server recomputes it under the weights held now)
            self._finish(req, FinishReason("abort", message=HANDED_BACK))
            return
        lead = self.cache.match(req.tokens[:n]).pages[:kv.start // P] if self.cache is not None else []
        if not stale and len(lead) == kv.start // P and None not in lead:
            self.pool.incref(lead)
            fresh = self.scheduler.alloc(cdiv(n, P) - len(lead))
            if fresh is None:
                self.pool.decref(lead)
            else:
                req.pages, req.num_computed = lead + fresh, n
                req.pages_replaced()
                try:
                    with self.order.work("kv_import"):
                        kv.write_into(self.pool, req.pages)
                except ValueError as e:  # (checked as written: what it wrote is nobody's)
                    self.pool.decref(req.pages)
                    req.pages, req.num_computed = [], 0
                    req.pages_replaced()
                    self.scheduler.waiting.append(req)
                    self._finish(req, FinishReason("abort", message=str(e)))
                    return
        if not req.pages:
            self.stats.imports_recomputed += 1
            log.info("engine: request %s recomputes its prompt (the import's cached prefix is gone, no pages are "
                     "free, or its KV is of other weights)", req.rid)
        self.scheduler.waiting.append(req)
