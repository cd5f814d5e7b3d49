"""The engine core's part in prefill/decode disaggregation (`tandem.engine.core` states it): the decode server's
end (`Probe`, `ImportRequest`: imports placed into fresh pages, held while paused, checked as written where they
come by reference) and the prefill server's pinned exports (pinned as the step completing their prompt is launched,
ready once it ran, let go by `unpin`). A part of `EngineCore`, split out by concept: its methods use the core's
state and run in its thread, as every command does, but for the two that say they are thread-safe (`unpin`,
`write_reserved`).

A prefill server's export by reference is pinned as soon as the step that computes the rest of its prompt is
launched (`_pin_launched`), before the device has run it, and named to `on_pinned` then: its decode server can
parse and prepare its pass while the prefill computes. Once the engine has the step's result (its sampled tokens,
which the device writes after the KV and the forward's checksum records) the export is ready (`_exports_ready`:
`PinnedKV.ready_at`, told to `on_ready`), and only then may anyone read its pages. A request retracted before that
drops its early pin (`_void_early`); the request's end takes it as its export (`_take_early`).

An import by reference may be written before its `ImportRequest` reaches the engine's thread: `Probe(reserve=True)`
sets pages aside for it (`Reservation`), and the decode server, as the prefill server's answer lands, writes the KV
into them from its own thread (`write_reserved`) and compares its checksums, so that the transfer does not wait
for a turn of the engine's thread; the import then only queues the request with those pages, if they were checked
and the same. The gate (`_gate`) keeps the guarantees: a write out of the thread holds it from its checks to its
pass done, and the engine takes it to pause (so no such write runs after a pause is acknowledged; an import that
arrives paused gives its pages back, and is written again after continue) and to take or drop a reservation (so
none is freed while it is written). A write out of the thread runs on the transfer stream (`kv_shared.transfer_stream`),
after the engine's work queued before the pages were set aside (`Reservation.ready`), not behind later steps; the
host waits for it before the request is queued, so every step that reads the pages comes after it. The pass may be
queued earlier still (`arm_reserved`), before the KV is complete, behind a doorbell the prefill engine rings once it
is (`doorbell`); `write_reserved` then takes its result. Whatever takes or drops the reservation, and a pause, rings
an armed pass's bell and waits for it first (`_disarm`), so no such pass is ever left queued."""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

import torch

from tandem.distributed.parallel import cdiv
from tandem.engine import commands
from tandem.engine.doorbell import Bell
from tandem.engine.kv_mapped import MappedKV, PinnedKV, pin_pages
from tandem.engine.kv_shared import transfer_stream
from tandem.engine.kv_transfer import KVPages
from tandem.engine.request import Request, Status
from tandem.engine.scheduler import PENDING
from tandem.types import HANDED_BACK, FinishReason

log = logging.getLogger("tandem.engine.core")


@dataclass(eq=False)
class Reservation:
    """Pages set aside for a probed import (`Probe(reserve=True)`): `pages`, the page table of its positions
    [0, `end`) (the cached pages before `start`, referenced, then fresh ones), set aside under weight `version`;
    `ready`: an event on the engine's stream as they were (a GPU's), after which their earlier users are done.
    `written`: the KV written into them out of the engine's thread (`write_reserved`); `armed`: its pass queued
    behind a doorbell, not yet taken (`arm_reserved`)."""

    pages: list[int]
    start: int
    end: int
    version: int
    ready: torch.cuda.Event | None
    written: object = None
    armed: Armed | None = None


@dataclass(eq=False)
class Armed:
    """A reservation's pass queued behind a doorbell (`arm_reserved`): `kv`'s pass (`MappedKV.launch_pass`) on
    the bell's stream, waiting for `bell` to ring; the reservation owns the bell until it is disarmed."""

    kv: MappedKV
    bell: Bell


class DecodeImports:
    """`EngineCore`'s disaggregation methods (the core sets `_unpins`, `_held`, `_expected`, `_reserved`,
    `_gate`)."""

    _unpins: collections.deque[list[int]]
    _reserved: dict[str, Reservation]
    _gate: threading.RLock

    def _pin_launched(self, launched) -> None:
        """Pin the exports by reference whose prompt the step just `launched` completes (`pin_pages`, the step's
        bookkeeping done: their pages and epochs noted, the records of pages the forward does not write queued
        behind it), name each to `on_pinned` with the step's weight version, and note them on the step
        (`launched.pinned`: `_exports_ready` says them ready once its result is in, never an earlier step's, which
        may be drained after this one is launched and may hold an earlier chunk of the same prompt). Not where the
        pool keeps routed experts: their export copies them to the host (the host would wait for the step), so
        those pin as the request ends."""
        launched.pinned = []
        if self.pool.routing is not None:
            return
        for c in launched.chunks:
            req = c.req
            if (req.rid in self._pinned_exports and req.rid not in self._early and c.sample
                    and req.num_computed == len(req.tokens) - 1):
                with self.order.work("kv_pin"):
                    kv = self._early[req.rid] = pin_pages(self.pool, req.pages, req.export_kv_from,
                                                          req.num_computed, self.unpin)
                launched.pinned.append((req.rid, kv))
                self._tell(self.on_pinned, req.rid, kv, launched.version)

    def _exports_ready(self, launched) -> None:
        """The step `launched` has run (its result is in): the exports pinned as it was launched, if still held, are
        ready to read (`PinnedKV.ready_at`), each told to `on_ready`."""
        now = time.monotonic()
        for rid, kv in getattr(launched, "pinned", ()):
            if self._early.get(rid) is kv and kv.ready_at is None:
                kv.ready_at = now
                self._tell(self.on_ready, rid, kv)

    def _void_early(self) -> None:
        """Unpin the early exports of requests no longer running (retracted: their KV is computed again)."""
        for rid in [rid for rid in self._early if getattr(self._requests.get(rid), "status", None)
                    is not Status.RUNNING]:
            self._early.pop(rid).free(taken=False)

    def _take_early(self, req: Request, exporting: bool) -> PinnedKV | None:
        """As `req` ends: its early pin if it is the export (`exporting`, of the positions the request computed),
        else None (the pin let go)."""
        kv = self._early.pop(req.rid, None)
        if kv is not None and exporting and (kv.start, kv.end) == (req.export_kv_from, req.num_computed) \
                and kv.ready_at is not None:
            return kv
        if kv is not None:
            kv.free(taken=False)
        return None

    @staticmethod
    def _tell(hook, rid: str, *args) -> None:
        """Call an export hook (a side channel: what it raises is logged, the answer carries the export anyway)."""
        if hook is not None:
            try:
                hook(rid, *args)
            except Exception:
                log.exception("engine: the export hook %s of %s failed", getattr(hook, "__name__", hook), rid)

    def unpin(self, pages: list[int]) -> None:
        """Drop the references a pinned export holds on `pages` (`kv_mapped.PinnedKV.free`). Thread-safe: the pages
        go back to the allocator before the next command is applied."""
        self._unpins.append(pages)

    def arm_reserved(self, rid: str, kv: MappedKV, version: int, bell: Bell) -> bool:
        """Thread-safe, for a decode server's thread as `rid`'s pages mail lands, before the prefill server has
        computed the KV: queue `kv`'s pass into the pages its probe set aside (`MappedKV.launch_pass`), on a stream
        of its own, behind a wait for `bell` (`doorbell`), which the prefill engine rings once the KV is complete, so
        the device runs the pass then, with no host of this side on its way. `write_reserved` later takes its
        result. False, nothing queued, where `write_reserved` would refuse, off a GPU, or if the pass cannot be
        queued; True: the reservation owns `bell` (rung and given back as the pass is taken or dropped,
        `_disarm`)."""
        with self._gate:
            res = self._reserved.get(rid)
            if not self._writable(res, kv, version) or res.armed is not None or not self.pool.k_cache.is_cuda:
                return False
            stream = bell.stream
            with torch.cuda.stream(stream):
                if res.ready is not None:
                    stream.wait_event(res.ready)
                bell.wait()
                try:
                    kv.launch_pass(self.pool, res.pages)
                except ValueError:  # (nothing queued behind the wait: let it go, and take the host's way)
                    bell.ring()
                    return False
            res.armed = Armed(kv, bell)
            return True

    def write_reserved(self, rid: str, kv: MappedKV, version: int) -> bool:
        """Thread-safe, for a decode server's thread as `rid`'s answer lands: write `kv` (KV computed under weight
        `version`) into the pages its probe set aside (`MappedKV.pass_into`, on the transfer stream; blocks for the
        pass); its caller then compares the checksums (`MappedKV.check`) before it sends the import, which takes
        the pages only if they were checked and the same. Where that pass was armed for this `kv`
        (`arm_reserved`), its bell is rung (the prefill engine rang it already, unless it could not) and its result
        taken. False, nothing written, if there is no such reservation (none set aside, dropped, or written
        already), the engine is paused, or `version` is not the engine's and the reservation's, or `kv` is not the
        positions reserved: the import then takes the engine's own way."""
        with self._gate:
            res = self._reserved.get(rid)
            if not self._writable(res, kv, version):
                return False
            if res.armed is not None and res.armed.kv is kv:
                res.armed.bell.ring()
                kv.finish_pass()
                res.armed.bell.give_back()
                res.armed, res.written = None, kv
                return True
            self._disarm(res)
            with transfer_stream(self.pool.k_cache.device) as stream:
                if stream is not None and res.ready is not None:
                    stream.wait_event(res.ready)
                try:
                    kv.pass_into(self.pool, res.pages, graphs=self.config.kv_pass_graphs)
                except ValueError as e:  # (what it wrote is nobody's)
                    kv.failure, kv.checked = str(e), True
            res.written = kv
            return True

    def _writable(self, res: Reservation | None, kv: MappedKV, version: int) -> bool:
        return not (res is None or res.written is not None or self.paused is not None
                    or not res.version == version == self.weight_version or (kv.start, kv.end) != (res.start, res.end))

    def _disarm(self, res: Reservation) -> None:
        """(Holding the gate.) Ring `res`'s armed bell and wait for its pass, whose result nobody takes (the pages
        it wrote are written again or go back), so that no pass into them is left queued."""
        if (armed := res.armed) is not None:
            res.armed = None
            armed.bell.ring()
            armed.bell.stream.synchronize()
            armed.bell.give_back()
            armed.kv.finish_pass()  # (its staging back for reuse; the result unused)

    def disarm_all(self) -> None:
        """Thread-safe: `_disarm` every reservation's armed pass (as the engine pauses or stops: none stays queued
        behind a bell nobody may ring)."""
        with self._gate:
            for res in self._reserved.values():
                self._disarm(res)

    def _probe(self, input_ids: list[int], reserve_for: str | None = None) -> int:
        """The leading tokens held in whole device pages; with `reserve_for`, pages set aside for that request's
        import of the rest (`Reservation`), if enough are free and the engine has one rank."""
        held, P = 0, self.pool.page_size
        if self.cache is not None:
            pages = self.cache.match(input_ids).pages
            held = next((i for i, page in enumerate(pages) if page is None), len(pages))
        if reserve_for is not None and self.tp.size == 1:
            self._release(self._take_reservation(reserve_for))  # (a probe again, after a hand-back)
            lead = pages[:held] if held else []
            self.pool.incref(lead)
            if (fresh := self.scheduler.alloc(cdiv(len(input_ids), P) - held)) is None:
                self.pool.decref(lead)
            else:
                ready = None
                if self.pool.k_cache.is_cuda:
                    ready = torch.cuda.Event()
                    ready.record(torch.cuda.current_stream(self.pool.k_cache.device))
                self._reserved[reserve_for] = Reservation(lead + fresh, held * P, len(input_ids),
                                                          self.weight_version, ready)
        return held * P

    def _take_reservation(self, rid: str) -> Reservation | None:
        """`rid`'s reservation, taken out of `_reserved` (the caller owns its pages: `_release` them or use them);
        waits for a write into them in flight."""
        with self._gate:
            if (res := self._reserved.pop(rid, None)) is not None:
                self._disarm(res)
            return res

    def _release(self, res: Reservation | None) -> None:
        if res is not None:
            self.pool.decref(res.pages)

    def _import_request(self, cmd: commands.ImportRequest) -> None:
        res = self._take_reservation(cmd.rid)  # (its pages are this command's now: used or released)
        try:
            self._import_request_with(cmd, res)
        except BaseException:
            self._release(res)
            raise

    def _import_request_with(self, cmd: commands.ImportRequest, res: Reservation | None) -> None:
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
        if reason is not None or self.paused is not None:  # (what was written before the pause is written again)
            self._release(res)
            res = None
        if reason is not None:  # the first token ended it, or an abort did
            kv.settle()
            self.scheduler.waiting.append(req)
            self._finish(req, reason)
        elif self.paused is not None:
            self._held.append((req, kv))
        else:
            self._place_import(req, kv, res)

    def _place_import(self, req: Request, kv: KVPages | MappedKV, res: Reservation | None = None) -> None:
        """Give the request its prompt's pages: the cached ones before `kv.start` (shared), fresh ones holding the
        imported KV after it; then queue it. The request computes its prompt here instead, nothing written, if those
        cached pages are gone (evicted or flushed since the probe), no pages are free, or the KV was computed under
        other weights than this engine holds now (KV never mixes weight versions silently; its tokens keep the
        versions that sampled them). KV whose checksums fail as it is written (`MappedKV`) ends the request with an
        abort naming the page, its pages freed (nothing of it is seen). With `res`, the pages its probe set aside:
        if `write_reserved` wrote `kv` into them under the weights held now and it was checked, the request takes
        them as they are (or, if its checksums differed, ends so, they freed); else they are freed and the import
        goes as above.
        The import is settled either way."""
        try:
            self._place_import_kv(req, kv, res)
        finally:
            kv.settle()

    def _place_import_kv(self, req: Request, kv: KVPages | MappedKV, res: Reservation | None) -> None:
        n, P = len(req.tokens) - 1, self.pool.page_size
        stale = req.weight_versions[-1] != self.weight_version
        if res is not None and res.written is kv and kv.checked and res.version == self.weight_version and not stale:
            if kv.failure is not None:
                self._release(res)
                self.scheduler.waiting.append(req)
                self._finish(req, FinishReason("abort", message=kv.failure))
            else:
                req.pages, req.num_computed = res.pages, n
                req.pages_replaced()
                self.scheduler.waiting.append(req)
                if isinstance(kv, MappedKV) and kv.clock is not None:
                    kv.clock.mark("placed", device=False)
            return
        self._release(res)
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
