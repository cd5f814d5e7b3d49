"""An import by reference written as its answer lands (`Probe(reserve=True)`, `EngineCore.write_reserved`), in
process on CPU: it decodes what one engine does, written once, out of the engine's thread; a pause acknowledged
before it lands stops it (nothing written until continue; falsifier: the pause check removed), and a pause or an
abort that comes while it is written waits for it to be checked (falsifier: a pause or abort that does not take
the writer's gate returns, or frees the pages, while they are written); a page changed after the export ends the
request naming it, its pages freed; a reservation goes back with an abort, none is made where the pages are not
free, and KV of other weights is not written so. Over HTTP: tests/test_disagg_transfer.py."""

import asyncio
import threading
import time

import torch
from disagg_helpers import write_reserved_blind_to_pause
from test_disagg_mapped import POOL, PREFILL, SEEDED, a_changed_page_is_named_and_nothing_of_it_kept, pinned, prompt

from tandem.engine.engine import Engine
from tandem.engine.kv_mapped import MappedKV, MappedPool, pool_handle
from tandem.engine.kv_transfer import TransferClock


def mapped(p: Engine, d: Engine, first) -> MappedKV:
    kv = MappedKV(MappedPool(pool_handle(p.pool), d.pool.k_cache.device), first.kv.handle, "prefill-here", "e")
    return kv.with_clock(TransferClock("cpu"))


async def import_landed(p: Engine, d: Engine, first, ids, rid="r", before_landing=None):
    """Probe with pages set aside, land the answer (`write_reserved`) and compare (as the decode server does once
    the prefill server's sums have come), import: (landed, output, kv)."""
    assert await d.probe(ids, rid, reserve=True) == 0
    kv = mapped(p, d, first)
    if before_landing is not None:
        await before_landing()
    landed = d.write_reserved(rid, kv, first.weight_versions[-1])
    if landed:
        kv.check()
    out = await d.generate_imported(ids, SEEDED, (first.output_ids, first.output_logprobs, first.weight_versions),
                                    kv, rid)
    return landed, out, kv


def count_writes(monkeypatch, method: str) -> list[str]:
    """Which thread wrote each import by reference (the callers of `MappedKV`'s `method`)."""
    threads, real = [], getattr(MappedKV, method)

    def counted(self, pool, pages, **options):
        threads.append(threading.current_thread().name)
        return real(self, pool, pages, **options)
    monkeypatch.setattr(MappedKV, method, counted)
    return threads


def test_an_import_written_as_it_lands_decodes_what_one_engine_does_written_once(monkeypatch):
    writers = count_writes(monkeypatch, "pass_into")

    async def go():
        with Engine("tiny", PREFILL) as p, Engine("tiny", POOL) as d, Engine("tiny", POOL) as unified:
            ids = prompt(22)
            want = await unified.generate(ids, SEEDED)
            first = await pinned(p, ids)
            landed, out, kv = await import_landed(p, d, first, ids)
            assert landed and "placed" in kv.clock.host and kv.clock.host["checked"] <= kv.clock.host["placed"]
            assert (out.output_ids, out.output_logprobs, out.weight_versions) == \
                (want.output_ids, want.output_logprobs, want.weight_versions)
            assert kv.settled.done()
            first.kv.free(taken=True)
            await d.flush_cache()
            assert (await d.get_stats()).pages_free == POOL.num_pages
    asyncio.run(go())
    assert writers == [threading.main_thread().name]  # once, by the thread the answer landed in


def landed_while_paused(monkeypatch, check_pause: bool) -> tuple[bool, bool]:
    """Probe, pause (in place), land the answer, import, continue: whether the write out of the thread ran, and
    whether the pool changed before the continue. `check_pause=False`: a mutant `write_reserved` that does not see
    the pause."""
    if not check_pause:
        write_reserved_blind_to_pause(monkeypatch)

    async def go():
        with Engine("tiny", PREFILL) as p, Engine("tiny", POOL) as d, Engine("tiny", POOL) as unified:
            ids = prompt(22)
            want = await unified.generate(ids, SEEDED)
            first = await pinned(p, ids)
            state = {}

            async def pause():
                await d.pause("in_place")
                state["before"] = d.pool.k_cache.clone()
            task = asyncio.ensure_future(import_landed(p, d, first, ids, before_landing=pause))
            while "before" not in state:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            await d.get_stats()  # (the import has been applied by now: commands run in order)
            written = not torch.equal(d.pool.k_cache, state["before"])
            await d.resume()
            landed, out, kv = await task
            assert (out.output_ids, out.output_logprobs) == (want.output_ids, want.output_logprobs)
            assert kv.settled.done()
            first.kv.free(taken=True)
            return landed, written
    return asyncio.run(go())


def test_a_pause_acknowledged_before_the_answer_lands_stops_its_write_until_continue(monkeypatch):
    assert landed_while_paused(monkeypatch, check_pause=True) == (False, False)


def test_the_landing_pause_falsifier_a_write_that_does_not_see_the_pause_writes_while_paused(monkeypatch):
    assert landed_while_paused(monkeypatch, check_pause=False) == (True, True)


def during_a_slow_write(monkeypatch, command: str, gated: bool) -> dict:
    """Land an answer whose write is slow (0.3 s, in a thread of its own) and, while it is written, pause the
    engine (`command` "pause") or abort the request ("abort"): when the command was acknowledged against when the
    write was checked, and whether the reserved pages were all still held as the write ended. `gated=False`: a
    mutant engine whose pause and reservations do not take the writer's gate."""
    real, seen = MappedKV.pass_into, {}

    def slow(self, pool, pages, **options):
        seen["started"] = time.monotonic()
        time.sleep(0.3)
        real(self, pool, pages, **options)
        seen["held"] = all(pool.refcount[page] > 0 for page in pages)
        seen["checked"] = time.monotonic()
    monkeypatch.setattr(MappedKV, "pass_into", slow)

    async def go():
        with Engine("tiny", PREFILL) as p, Engine("tiny", POOL) as d:
            ids = prompt(22)
            first = await pinned(p, ids)
            await d.probe(ids, "r", reserve=True)
            kv = mapped(p, d, first)
            writing = asyncio.ensure_future(asyncio.to_thread(d.write_reserved, "r", kv, first.weight_versions[-1]))
            while "started" not in seen:
                await asyncio.sleep(0.005)
            if not gated:
                d.core._gate = threading.RLock()  # (the engine's own from now on: not the one the write holds)
            if command == "pause":
                await d.pause("in_place")
            else:
                d.abort("r")
                await d.get_stats()
            seen["acknowledged"] = time.monotonic()
            assert await writing
            await d.resume()
            first.kv.free(taken=True)
            await d.flush_cache()
            seen["free"] = (await d.get_stats()).pages_free
    asyncio.run(go())
    return seen


def test_a_pause_or_an_abort_during_a_landed_write_waits_for_it_to_be_checked(monkeypatch):
    for command in ("pause", "abort"):
        seen = during_a_slow_write(monkeypatch, command, gated=True)
        assert seen["acknowledged"] >= seen["checked"] and seen["held"], (command, seen)
    assert seen["free"] == POOL.num_pages  # (the abort gave the reservation back)


def test_the_gate_falsifier_an_ungated_pause_or_abort_comes_back_while_the_pages_are_written(monkeypatch):
    seen = during_a_slow_write(monkeypatch, "pause", gated=False)
    assert seen["acknowledged"] < seen["checked"]
    seen = during_a_slow_write(monkeypatch, "abort", gated=False)
    assert seen["acknowledged"] < seen["checked"] and not seen["held"]


def test_a_landed_write_of_a_changed_page_ends_the_request_naming_it_its_pages_freed():
    async def landed(p, d, first, ids):
        ok, out, kv = await import_landed(p, d, first, ids)
        assert ok
        return out, kv
    a_changed_page_is_named_and_nothing_of_it_kept(landed)


def test_reservations_go_back_with_an_abort_need_free_pages_and_the_weights_they_were_made_under():
    async def go():
        with Engine("tiny", PREFILL) as p, Engine("tiny", POOL) as d:
            ids = prompt(22)
            first = await pinned(p, ids)
            await d.probe(ids, "r", reserve=True)
            assert (await d.get_stats()).pages_free == POOL.num_pages - 6
            assert not d.write_reserved("r", mapped(p, d, first), first.weight_versions[-1] + 1)  # other weights
            d.abort("r")
            assert (await d.get_stats()).pages_free == POOL.num_pages
            assert not d.write_reserved("r", mapped(p, d, first), first.weight_versions[-1])  # none set aside now
            await d.probe(prompt(4 * POOL.num_pages + 1), "big", reserve=True)  # (more than the pool)
            assert (await d.get_stats()).pages_free == POOL.num_pages
            d.abort("big")
            first.kv.free(taken=True)
    asyncio.run(go())


def test_a_pause_between_the_landed_pass_and_its_check_has_the_engine_write_it_again_after_continue():
    """The pass ran before the pause (allowed: nothing of it is used yet); the import arriving while paused waits,
    its set-aside pages go back, and after continue the engine writes it again (from the prefill server's pages,
    still pinned): one engine's tokens, every page back once done."""
    async def go():
        with Engine("tiny", PREFILL) as p, Engine("tiny", POOL) as d, Engine("tiny", POOL) as unified:
            ids = prompt(22)
            want = await unified.generate(ids, SEEDED)
            first = await pinned(p, ids)
            await d.probe(ids, "r", reserve=True)
            kv = mapped(p, d, first)
            assert d.write_reserved("r", kv, first.weight_versions[-1])
            await d.pause("in_place")
            kv.check()
            task = asyncio.ensure_future(d.generate_imported(
                ids, SEEDED, (first.output_ids, first.output_logprobs, first.weight_versions), kv, "r"))
            await asyncio.sleep(0.05)
            await d.get_stats()
            assert not task.done() and (await d.get_stats()).pages_free == POOL.num_pages  # held, pages back
            await d.resume()
            out = await task
            assert (out.output_ids, out.output_logprobs) == (want.output_ids, want.output_logprobs)
            assert "placed" not in kv.clock.host  # (written by the engine, not taken as landed)
            first.kv.free(taken=True)
            await d.flush_cache()
            assert (await d.get_stats()).pages_free == POOL.num_pages
    asyncio.run(go())
