"""The KV transfer by reference with the prefill pool mapped once (`tandem.engine.kv_mapped`), in process on CPU
(fp32; the prefill engine's pool in shared memory): a pinned export survives its engine freeing the pages and
writing a pool's worth of other prompts (falsifier: unpinned at once, the pages are reused and the import fails:
they were handed out again, their epochs say; and without that check it would keep their new KV, whose records
match it); a page changed after the export ends the import with an abort naming it, its pages freed and
nothing cached; a paused decode engine writes nothing of an import until it continues (falsifier: a late gate);
an engine whose requests wait for pages a pinned export holds waits for commands rather than spinning (falsifier:
it steps again at once).
The servers' protocol over HTTP: tests/test_disagg_transfer.py."""

import asyncio
import dataclasses
import gc
import time

import numpy as np
import pytest
import torch
from disagg_helpers import gate_imports_late

from tandem.config import EngineConfig
from tandem.engine import kv_mapped
from tandem.engine.engine import Engine
from tandem.engine.kv_mapped import MappedKV, MappedPool, PinnedKV, pool_handle
from tandem.types import SamplingParams

POOL = EngineConfig(page_size=4, num_pages=96)
PREFILL = dataclasses.replace(POOL, role="prefill")
SEEDED = SamplingParams(max_new_tokens=6, temperature=0.8, seed=5, ignore_eos=True)


def hex_pages(pages: list[int]) -> str:
    """Page ids as a handle carries them (the hex of their int32 bytes)."""
    return np.asarray(pages, dtype="<i4").tobytes().hex()


def prompt(n, seed=0):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def pinned(p: Engine, ids: list[int]) -> PinnedKV:
    first = await p.generate(ids, dataclasses.replace(SEEDED, max_new_tokens=1), export_kv_from=0,
                             export_pinned=True)
    assert isinstance(first.kv, PinnedKV)
    return first


async def import_mapped(p: Engine, d: Engine, first, ids, rid=None):
    kv = MappedKV(MappedPool(pool_handle(p.pool), d.pool.k_cache.device), first.kv.handle, "prefill-here", "e")
    out = await d.generate_imported(ids, SEEDED, (first.output_ids, first.output_logprobs, first.weight_versions),
                                    kv, rid)
    return out, kv


def churn_after_pinning(monkeypatch, pin: bool, epochs: bool = True):
    """Export a prompt by pinning, flush the prefill engine's cache and run other prompts through it (their pages
    reuse what is free), then import the export: its output and the decode engine's free pages after it.
    `pin=False`: a mutant export whose pages are unpinned at once; `epochs=False`: a mutant import that does not
    see the pages' epochs change."""
    if not epochs:
        real_pass = MappedKV.pass_into

        def blind(self, pool, pages, **options):
            real_pass(self, pool, pages, **options)
            self.epochs_after = self.epochs
        monkeypatch.setattr(MappedKV, "pass_into", blind)
    if not pin:
        real = kv_mapped.pin_pages

        def unpinned(*args, **kwargs):
            kv = real(*args, **kwargs)
            kv.free(taken=True)
            return kv
        for where in ("core", "core_imports"):  # (pinned as launched; as the request ends where it was not)
            monkeypatch.setattr(f"tandem.engine.{where}.pin_pages", unpinned)

    async def go():
        with Engine("tiny", PREFILL) as p, Engine("tiny", POOL) as d, Engine("tiny", POOL) as unified:
            ids = prompt(22)
            want = await unified.generate(ids, SEEDED)
            first = await pinned(p, ids)
            await p.flush_cache()
            assert (await p.get_stats()).pages_free == POOL.num_pages - 6 * pin
            for seed in range(3):  # (most of the pool: the pages freed last are handed out first)
                await p.generate(prompt(100, seed=seed + 1), dataclasses.replace(SEEDED, max_new_tokens=1))
            out, kv = await import_mapped(p, d, first, ids)
            assert kv.settled.done() and kv.checksums == first.kv.checksums and len(kv.checksums) == 6
            first.kv.free(taken=True)
            await p.flush_cache()
            assert (await p.get_stats()).pages_free == POOL.num_pages  # unpinned once freed (twice: once)
            return out, want, (await d.get_stats()).pages_free
    return asyncio.run(go())


def test_a_pinned_export_survives_its_pages_being_freed_and_the_pool_reused(monkeypatch):
    out, want, _ = churn_after_pinning(monkeypatch, pin=True)
    assert (out.output_ids, out.output_logprobs, out.weight_versions) == \
        (want.output_ids, want.output_logprobs, want.weight_versions)


def test_the_pin_falsifier_unpinned_pages_are_reused_and_the_import_fails(monkeypatch):
    out, _, free = churn_after_pinning(monkeypatch, pin=False)
    assert out.finish_reason.type == "abort" and "prefill-here" in out.finish_reason.message, out.finish_reason
    assert "page 0 (positions 0...) was handed out again" in out.finish_reason.message
    assert free == POOL.num_pages  # the pages it wrote are free, none cached


def test_the_epochs_falsifier_pages_handed_out_again_are_read_as_they_are_now_and_kept(monkeypatch):
    out, want, _ = churn_after_pinning(monkeypatch, pin=False, epochs=False)
    assert out.finish_reason.type != "abort", out.finish_reason  # (their records are of what they hold now)
    assert out.output_logprobs != want.output_logprobs  # (another prompt's KV, kept)


def a_changed_page_is_named_and_nothing_of_it_kept(importer) -> None:
    """Export 18 positions, change position 9 (the third page) in the prefill pool, import them by `importer(p, d,
    first, ids)` -> (output, MappedKV): an abort naming the page and the prefill server, the decode pages all free,
    nothing cached, the import settled. (Shared with tests/test_disagg_landed.py.)"""
    async def go():
        with Engine("tiny", PREFILL) as p, Engine("tiny", POOL) as d:
            ids = prompt(18)
            first = await pinned(p, ids)
            p.pool.v_cache[1, first.kv.pages[2] * 4 + 1, 0, 5] += 1.0  # position 9: the third page
            out, kv = await importer(p, d, first, ids)
            assert out.finish_reason.type == "abort", out.finish_reason
            assert "page 2 (positions 8...)" in out.finish_reason.message and out.output_ids == first.output_ids
            assert "prefill-here" in out.finish_reason.message
            assert kv.settled.done() and (await d.get_stats()).pages_free == POOL.num_pages
            assert await d.probe(ids) == 0  # nothing of it cached
            first.kv.free(taken=True)
    asyncio.run(go())


def test_a_page_changed_after_the_export_is_named_and_nothing_of_it_is_kept():
    a_changed_page_is_named_and_nothing_of_it_kept(lambda p, d, first, ids: import_mapped(p, d, first, ids, "r1"))


def writes_while_paused(monkeypatch, gate_late: bool) -> bool:
    """Pause the decode engine (in place), import a request by reference, read the pool, continue: whether the
    pool changed before the continue (and the import settled only after it). `gate_late`: a mutant core that places
    imports whatever the pause."""
    if gate_late:
        gate_imports_late(monkeypatch)

    async def go():
        with Engine("tiny", PREFILL) as p, Engine("tiny", POOL) as d:
            ids = prompt(22)
            first = await pinned(p, ids)
            await d.pause("in_place")
            before = d.pool.k_cache.clone()
            task = asyncio.ensure_future(import_mapped(p, d, first, ids))
            await asyncio.sleep(0.05)  # (the task submits its import)
            await d.get_stats()  # (which has been applied: commands run in order)
            written = not torch.equal(d.pool.k_cache, before)
            await d.resume()
            out, kv = await task
            assert len(out.output_ids) == SEEDED.max_new_tokens and not torch.equal(d.pool.k_cache, before)
            assert kv.settled.done()
            return written
    return asyncio.run(go())


def test_an_import_by_reference_arriving_while_paused_writes_nothing_until_continue(monkeypatch):
    assert not writes_while_paused(monkeypatch, gate_late=False)


def test_the_pause_gate_falsifier_a_late_gate_writes_a_reference_while_paused(monkeypatch):
    assert writes_while_paused(monkeypatch, gate_late=True)


def test_a_handle_of_another_pool_or_pages_that_do_not_fit_is_refused():
    async def go():
        with Engine("tiny", PREFILL) as p:
            first = await pinned(p, prompt(10))
            source = MappedPool(pool_handle(p.pool), "cpu")
            with pytest.raises(ValueError, match="restarted"):
                MappedKV(source, first.kv.handle | {"pool": "another"})
            with pytest.raises(ValueError, match="one each a page"):
                MappedKV(source, first.kv.handle | {"pages": hex_pages(first.kv.pages[:-1])})
            with pytest.raises(ValueError, match="do not hold positions"):
                MappedKV(source, first.kv.handle | {"end": 20})
            with pytest.raises(ValueError, match="do not hold positions"):
                MappedKV(source, first.kv.handle | {"pages": hex_pages([0, 1, POOL.num_pages])})
            first.kv.free(taken=True)
        with pytest.raises(ValueError, match="no checksum records"), Engine("tiny", POOL) as unified:
            pool_handle(unified.pool)
    asyncio.run(go())


def test_a_pool_that_shared_memory_cannot_hold_is_private_and_offers_no_reference(monkeypatch):
    """/dev/shm full (its space is reserved as the pool is made): the pool falls back to private memory, and its
    prefill server offers bytes (and point to point), not a reference it could not honour."""
    from tandem.server.disagg_prefill import offered

    with Engine("tiny", PREFILL) as p:
        assert p.pool.shm_path is not None and "reference" in offered(p)

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.posix_fallocate", full)
    with Engine("tiny", PREFILL) as p:
        assert p.pool.shm_path is None and offered(p) == ["bytes", "p2p"]


def dropped_export_pins(monkeypatch, collected: bool) -> int:
    """A pinned export dropped unfreed (its answer lost: the client went away): the pages still pinned once it is
    collected and the prefill engine's cache flushed. `collected=False`: a mutant export that unpins only when
    freed."""
    if not collected:
        monkeypatch.setattr(kv_mapped.weakref, "finalize", lambda obj, unpin, pages: lambda: unpin(pages))

    async def go():
        with Engine("tiny", PREFILL) as p:
            first = await pinned(p, prompt(18))
            del first
            gc.collect()
            await p.flush_cache()
            return POOL.num_pages - (await p.get_stats()).pages_free
    return asyncio.run(go())


def test_an_export_dropped_unfreed_unpins_its_pages_as_it_is_collected(monkeypatch):
    assert dropped_export_pins(monkeypatch, collected=True) == 0


def test_the_collection_falsifier_an_export_dropped_unfreed_stays_pinned(monkeypatch):
    assert dropped_export_pins(monkeypatch, collected=False) == 5


def pinned_as_launched(monkeypatch, retract: bool = False, void: bool = True) -> tuple[list, object]:
    """A prompt exported by pinning through a prefill engine whose hooks record what they are told (`on_pinned`,
    `on_ready`): the calls (name, rid, ready_at as told) and the output. `retract`: the request is retracted as it
    is pinned (as the next schedule may, short of pages); `void=False`: a mutant engine that keeps such a pin."""
    from tandem.engine.core import EngineCore

    if not void:
        monkeypatch.setattr(EngineCore, "_void_early", lambda self: None)
    calls = []

    async def go():
        with Engine("tiny", PREFILL) as p:
            core = p.core

            def on_pinned(rid, kv, version):
                calls.append(("pinned", rid, kv.ready_at, kv))
                if retract:
                    core.scheduler.retract(core._requests[rid])
            core.on_pinned = on_pinned
            core.on_ready = lambda rid, kv: calls.append(("ready", rid, kv.ready_at, kv))
            first = await p.generate(prompt(18), dataclasses.replace(SEEDED, max_new_tokens=1), "r",
                                     export_kv_from=0, export_pinned=True)
            if first.kv is not None:
                first.kv.free(taken=True)
            await p.flush_cache()
            assert (await p.get_stats()).pages_free == POOL.num_pages and not core._early
            return first
    return calls, asyncio.run(go())


def test_an_export_is_pinned_as_its_step_is_launched_and_ready_once_its_result_is_in(monkeypatch):
    """The pin is named before the step's result is in (no `ready_at`), then ready; the export is that pin."""
    calls, first = pinned_as_launched(monkeypatch)
    assert [(name, rid) for name, rid, *_ in calls] == [("pinned", "r"), ("ready", "r")], calls
    assert calls[0][2] is None and calls[1][2] is not None and calls[0][3] is calls[1][3] is first.kv
    assert calls[1][2] >= first.kv.pinned_at and (first.kv.start, first.kv.end) == (0, 18)


def test_a_request_retracted_after_its_pin_is_never_said_ready_and_its_pin_let_go(monkeypatch):
    calls, first = pinned_as_launched(monkeypatch, retract=True)
    assert [name for name, *_ in calls] == ["pinned"] and first.kv is None, calls


def test_the_retraction_falsifier_a_kept_pin_is_said_ready_for_an_export_that_never_comes(monkeypatch):
    calls, first = pinned_as_launched(monkeypatch, retract=True, void=False)
    assert [name for name, *_ in calls] == ["pinned", "ready"] and first.kv is None, calls


def steps_while_stalled(monkeypatch, wait: bool) -> tuple[int, object]:
    """A prefill engine whose pool a pinned export holds (not released yet) and a request that cannot be admitted
    until it is: the steps the engine takes in 0.3 s of that, and the request's output once the export is freed.
    `wait=False`: a mutant engine that never counts itself stalled (it steps again at once)."""
    from tandem.engine.core import EngineCore

    steps, real = [], EngineCore._step

    def counted(self, tier_ready):
        steps.append(1)
        real(self, tier_ready)
        if not wait:
            self.stalled = False
    monkeypatch.setattr(EngineCore, "_step", counted)

    async def go():
        with Engine("tiny", dataclasses.replace(PREFILL, num_pages=12)) as p:
            first = await pinned(p, prompt(30))  # (8 pages pinned, the cache flushed: 4 free)
            await p.flush_cache()
            waiting = asyncio.ensure_future(p.generate(prompt(24, seed=2), dataclasses.replace(SEEDED,
                                                                                         max_new_tokens=2)))
            await asyncio.sleep(0.1)
            before = len(steps)
            await asyncio.sleep(0.3)
            during = len(steps) - before
            first.kv.free(taken=True)
            return during, await asyncio.wait_for(waiting, 10)
    return asyncio.run(go())


def test_an_engine_waiting_for_pinned_pages_waits_for_commands_instead_of_spinning(monkeypatch):
    during, out = steps_while_stalled(monkeypatch, wait=True)
    assert during <= 0.3 / 0.001 + 10 and len(out.output_ids) == 2, during  # (one step a STALL_WAIT_S at most)


def test_the_stall_falsifier_an_engine_that_steps_at_once_spins(monkeypatch):
    during, _ = steps_while_stalled(monkeypatch, wait=False)
    assert during > 3 * (0.3 / 0.001), during


def ready_steps(monkeypatch, premature: bool = False) -> list[bool]:
    """A prompt in three chunks through a prefill engine that launches each step before it reads the last one's
    result: for the export, whether it was said ready as the result of the very step that pinned it (the one that
    completes the prompt) was read. `premature=True`: a mutant that says ready an export pinned in any step whose
    result is read, as an earlier chunk's step is drained after the pinning step's launch."""
    from tandem.engine.core import EngineCore

    if premature:
        def any_chunk(self, launched):
            for c in launched.chunks:
                if (kv := self._early.get(c.req.rid)) is not None and kv.ready_at is None:
                    kv.ready_at = time.monotonic()
                    self._tell(self.on_ready, c.req.rid, kv)
        monkeypatch.setattr(EngineCore, "_exports_ready", any_chunk)
    drain, pin, draining, pinned_by, seen = EngineCore._drain, EngineCore._pin_launched, [None], {}, []

    def noted_drain(self):
        draining[0] = self._inflight
        drain(self)

    def noted_pin(self, launched):
        pin(self, launched)
        pinned_by.update((rid, launched) for rid in self._early if rid not in pinned_by)
    monkeypatch.setattr(EngineCore, "_drain", noted_drain)
    monkeypatch.setattr(EngineCore, "_pin_launched", noted_pin)

    async def go():
        with Engine("tiny", dataclasses.replace(PREFILL, max_prefill_tokens=8)) as p:
            assert p.config.overlap
            p.core.on_ready = lambda rid, kv: seen.append(draining[0] is pinned_by[rid])
            first = await pinned(p, prompt(22))
            first.kv.free(taken=True)
    asyncio.run(go())
    return seen


def test_an_export_is_said_ready_only_as_the_result_of_the_step_that_pinned_it_is_read(monkeypatch):
    assert ready_steps(monkeypatch) == [True]


def test_the_ready_falsifier_an_earlier_chunks_step_drained_after_the_pin_says_it_ready_too_early(monkeypatch):
    assert ready_steps(monkeypatch, premature=True) == [False]
