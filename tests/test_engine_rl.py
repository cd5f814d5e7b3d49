"""The engine's RL controls end to end on CPU: pause modes, weight updates and the versions they tag, the prefix
cache across updates, and the engine's idle and command-wait accounting."""

import asyncio
import time

import pytest
import torch
from test_engine import GREEDY, LONG, _wait_tokens, prompts

from tandem.config import EngineConfig
from tandem.engine.engine import Engine, EngineError
from tandem.model.attention import PackedCausal
from tandem.model.loader import build_model
from tandem.types import SamplingParams


def test_pause_abort_returns_partial_outputs():
    with Engine("tiny") as engine:
        async def go():
            tasks = [asyncio.create_task(engine.generate(p, LONG)) for p in prompts(4, 512, seed=7)]
            await _wait_tokens(engine, 10)
            await engine.pause("abort")
            outs = await asyncio.gather(*tasks)
            late = asyncio.create_task(engine.generate([5, 6, 7], GREEDY))  # queued while paused
            await asyncio.sleep(0.05)
            assert not late.done()
            await engine.resume()
            return outs, await late

        outs, late = asyncio.run(go())
        stats = asyncio.run(engine.get_stats())
    assert all(o.finish_reason.type == "abort" for o in outs)
    assert all(len(o.output_ids) < 60 for o in outs) and sum(len(o.output_ids) for o in outs) >= 10
    assert late.finish_reason.type == "length" and len(late.output_ids) == 12
    assert stats.num_running == 0 and stats.pages_free + stats.pages_cached == stats.pages_total


def test_arriving_requests_do_not_wait_for_the_step_in_flight():
    """A new request only joins the queue: adding it must not drain the step in flight (the device would idle while
    the host builds the next step), unlike a command that needs every sampled token, such as a stats snapshot."""
    with Engine("tiny") as engine:
        async def go():
            long = [asyncio.create_task(engine.generate(p, LONG)) for p in prompts(2, 512, seed=3)]
            await _wait_tokens(engine, 4)
            before = (await engine.get_stats()).command_waits
            for p in prompts(10, 512, seed=4):  # one at a time, each while the long ones decode
                await engine.generate(p, SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True))
            after = await engine.get_stats()
            assert after.num_running >= 2, "the long requests should still be decoding"
            await asyncio.gather(*long)
            return after.command_waits - before

        waits = asyncio.run(go())
    assert waits <= 1, f"{waits} commands waited for the step in flight; at most the last snapshot should have"


def test_idle_time_counts_only_time_with_nothing_to_run():
    """The engine's idle time (the async benchmark's engine idle) grows while it has no request or is paused, and not
    while it generates, however much time its thread spends between steps."""
    with Engine("tiny") as engine:
        async def go():
            t0, start = time.perf_counter(), await engine.get_stats()
            await asyncio.sleep(0.3)
            rested, t1 = await engine.get_stats(), time.perf_counter()
            await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=64, ignore_eos=True))
                                   for p in prompts(4, 512, seed=5)])
            t2, generated = time.perf_counter(), await engine.get_stats()
            await engine.pause("in_place")
            await asyncio.sleep(0.2)
            await engine.resume()
            paused = await engine.get_stats()
            return (rested.idle_seconds - start.idle_seconds, t1 - t0,
                    generated.idle_seconds - rested.idle_seconds, t2 - t1, paused.idle_seconds - generated.idle_seconds)

        rested, rested_wall, generating, generating_wall, paused = asyncio.run(go())
    assert 0.25 <= rested <= rested_wall
    assert generating < 0.1 * generating_wall, f"idle {generating:.3f} s of {generating_wall:.3f} s generating"
    assert paused >= 0.15


def _perturbed_weights(model, seed):
    gen = torch.Generator().manual_seed(seed)
    return {name: p.detach() + 0.05 * torch.randn(p.shape, generator=gen) for name, p in model.named_parameters()}


def test_retract_update_resume_continues_with_new_weights():
    prompt = prompts(1, 512, 30, 31, seed=8)[0]
    with Engine("tiny", EngineConfig(page_size=4)) as engine:
        new_weights = _perturbed_weights(engine.model, 0)

        async def go():
            task = asyncio.create_task(engine.generate(prompt, LONG))
            await _wait_tokens(engine, 15)
            await engine.pause("retract")
            assert (await engine.get_stats()).pages_free + (await engine.get_stats()).pages_cached == 512
            assert await engine.update_weights(new_weights.items()) == 1
            assert (await engine.get_stats()).pages_cached == 0  # old-weight KV is gone
            await engine.resume()
            return await task

        out = asyncio.run(go())
    k = out.weight_versions.index(1)
    assert 0 < k < len(out.output_ids) and set(out.weight_versions[k:]) == {1}
    assert out.num_retractions == 1
    fresh_model = build_model("tiny")
    fresh_model.load_state_dict(new_weights)
    with Engine(fresh_model, EngineConfig(page_size=4)) as fresh:
        ref = asyncio.run(fresh.generate(prompt + out.output_ids[:k], SamplingParams(
            temperature=0, max_new_tokens=len(out.output_ids) - k, ignore_eos=True)))
    assert ref.output_ids == out.output_ids[k:]
    assert ref.output_logprobs == pytest.approx(out.output_logprobs[k:], abs=1e-5)


def test_in_place_pause_keeps_kv_and_never_shares_it():
    prompt = prompts(1, 512, 30, 31, seed=9)[0]
    with Engine("tiny", EngineConfig(page_size=4)) as engine:
        new_weights = _perturbed_weights(engine.model, 1)

        async def go():
            task = asyncio.create_task(engine.generate(prompt, LONG))
            await _wait_tokens(engine, 15)
            await engine.pause("in_place")
            stats = await engine.get_stats()
            assert stats.num_running == 1 and stats.generated_tokens < 60
            with pytest.raises(EngineError, match="flush_cache: refused while 1 request"):
                await engine.flush_cache()
            await engine.update_weights(new_weights.items(), version=7)
            await engine.resume()
            frozen = await task
            # the frozen request's KV is from version 0; a new request with the same prefix must not reuse it
            again = await engine.generate(prompt + frozen.output_ids, SamplingParams(max_new_tokens=1))
            return frozen, again

        frozen, again = asyncio.run(go())
    assert frozen.num_retractions == 0 and frozen.finish_reason.type == "length"
    assert 0 in frozen.weight_versions and frozen.weight_versions[-1] == 7
    assert again.cached_tokens == 0 and again.weight_versions == [7]


def test_a_load_in_place_tags_each_token_with_the_weights_that_computed_it():
    """A load in place does not wait for the step in flight: its copies queue behind that step, whose tokens keep
    the old version. Each token tagged 0 has the old model's logprob (teacher-forced); the first one tagged 1 was
    computed by the new weights, so it does not."""
    prompt = prompts(1, 512, 30, 31, seed=10)[0]
    sampled = SamplingParams(temperature=1.0, seed=3, max_new_tokens=60, ignore_eos=True)
    with Engine("tiny", EngineConfig(page_size=4)) as engine:
        new_weights = _perturbed_weights(engine.model, 2)

        async def go():
            task = asyncio.create_task(engine.generate(prompt, sampled))
            await _wait_tokens(engine, 15)
            await engine.load_paused(new_weights.items(), 1, "in_place")
            return await task

        out = asyncio.run(go())
    k = out.weight_versions.index(1)
    assert 0 < k < len(out.output_ids) and set(out.weight_versions[k:]) == {1}
    ids = torch.tensor(prompt + out.output_ids)
    with torch.no_grad():
        old = build_model("tiny")  # the engine's weights before the load
        logits = old.compute_logits(old(ids, torch.arange(len(ids)), PackedCausal([len(ids)])))
    old_logprobs = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, ids[len(prompt):, None])[:, 0]
    assert out.output_logprobs[:k] == pytest.approx(old_logprobs[:k].tolist(), abs=1e-5)
    assert abs(out.output_logprobs[k] - old_logprobs[k].item()) > 1e-3


def test_update_weights_requires_pause_and_rejects_bad_tensors():
    with Engine("tiny") as engine:
        good = _perturbed_weights(engine.model, 2)
        with pytest.raises(EngineError, match="must be paused"):
            asyncio.run(engine.update_weights(good.items()))
        asyncio.run(engine.pause("abort"))
        before = engine.model.model.norm.weight.clone()
        with pytest.raises(ValueError, match="unknown parameter"):
            asyncio.run(engine.update_weights([("model.norm.weight", good["model.norm.weight"]), ("bogus", before)]))
        assert torch.equal(engine.model.model.norm.weight, before)
        assert asyncio.run(engine.get_stats()).weight_version == 0


def test_load_paused_pauses_only_an_engine_that_was_running_and_leaves_a_paused_one_paused():
    with Engine("tiny") as engine:
        async def go():
            seconds = await engine.load_paused(_perturbed_weights(engine.model, 3).items(), 5, "retract")
            running = engine.paused is None and (await engine.get_stats()).weight_version == 5
            with pytest.raises(ValueError, match="unknown parameter"):  # a bad tensor: refused, and running again
                await engine.load_paused([("bogus", torch.zeros(1))], 9, "retract")
            running = running and engine.paused is None
            await engine.pause("abort")
            await engine.load_paused(_perturbed_weights(engine.model, 4).items(), 6, "retract")
            return seconds, running, engine.paused is not None, (await engine.get_stats()).weight_version

        seconds, running, still_paused, version = asyncio.run(go())
        assert seconds > 0 and running and still_paused and version == 6


@pytest.mark.parametrize("mode", ["retract", "abort"])
def test_a_weight_update_does_not_cache_the_kv_it_replaces(mode):
    """Retracting (or aborting) the running requests for a weight update must not insert their KV into the prefix
    cache first: the update empties it, and with many requests running the inserts were most of the pause."""
    with Engine("tiny") as engine:
        inserted, during = [], []
        insert, load_weights = engine.cache.insert, engine.core._load_weights
        engine.cache.insert = lambda tokens, pages: inserted.append(len(tokens)) or insert(tokens, pages)

        def counted(*args):  # the inserts made by the update's command (the engine's steps insert prompts too)
            before = len(inserted)
            try:
                return load_weights(*args)
            finally:
                during.extend(inserted[before:])

        engine.core._load_weights = counted

        async def go():
            tasks = [asyncio.create_task(engine.generate(p, LONG)) for p in prompts(4, 512, seed=3)]
            await _wait_tokens(engine, 8)
            await engine.load_paused(_perturbed_weights(engine.model, 5).items(), 1, mode)
            return await asyncio.gather(*tasks)

        outs = asyncio.run(go())
    assert during == [], f"{len(during)} requests' KV cached just before the update emptied the cache"
    if mode == "retract":  # they went on under the new weights
        assert all(o.weight_versions[-1] == 1 for o in outs)


def test_prefix_cache_max_age_reuses_kv_up_to_that_many_updates_old():
    """With prefix_cache_max_age 2, KV computed before one or two updates is reused and the third update empties
    the cache; a request running across that update is never shared afterwards, one running across an update that
    kept the cache is."""
    prompt, other = prompts(2, 512, 30, 31, seed=11)
    greedy = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    with Engine("tiny", EngineConfig(page_size=4, prefix_cache_max_age=2)) as engine:
        async def update(seed):
            await engine.load_paused(_perturbed_weights(engine.model, seed).items(), None, "in_place")

        async def across_update(p, seed):  # a request running while an update lands in place
            task = asyncio.create_task(engine.generate(p, LONG))
            await _wait_tokens(engine, (await engine.get_stats()).generated_tokens + 5)
            await update(seed)
            return await task

        async def go():
            await engine.generate(prompt, greedy)
            hits = []
            for seed in (20, 21):  # ages 1 and 2: kept
                await update(seed)
                hits.append((await engine.generate(prompt, greedy)).cached_tokens)
            kept = await across_update(other, 22)  # age 3: emptied, with `other` running
            hits.append((await engine.generate(prompt, greedy)).cached_tokens)
            hits.append((await engine.generate(other + kept.output_ids, greedy)).cached_tokens)
            running = await across_update(other[:-1], 23)  # age 1: kept, with it running
            hits.append((await engine.generate(other[:-1] + running.output_ids, greedy)).cached_tokens)
            return hits

        hits = asyncio.run(go())
    assert hits[:2] == [len(prompt) - 1] * 2  # all but the last token, which is computed to sample
    assert hits[2:4] == [0, 0]
    assert hits[4] > len(other)


def test_a_step_or_command_that_stalls_the_engine_is_logged_naming_it(caplog, monkeypatch):
    """Every request waits for a slow iteration of the engine's loop; the log names what it was (a step with its
    size, or a command), so a stall is never silent."""
    import tandem.engine.core as core_module

    with Engine("tiny") as engine:
        with caplog.at_level("WARNING", logger="tandem.engine.core"):
            asyncio.run(engine.generate([1, 2, 3], GREEDY))
            # (a tiny model's steps are far below the threshold)
            assert not [r for r in caplog.records if r.name == "tandem.engine.core"]
            monkeypatch.setattr(core_module, "SLOW_ITERATION_S", 0.0)
            asyncio.run(engine.generate([9, 8, 7, 6, 5], SamplingParams(max_new_tokens=2, temperature=0)))
            asyncio.run(engine.get_stats())
    logged = [r.getMessage() for r in caplog.records]
    assert any("(requests 1, tokens 5) took" in m for m in logged), logged  # the prefill
    assert any("(requests 1, tokens 1) took" in m for m in logged), logged  # the decode step
    assert any(m.startswith("engine: command Snapshot took") for m in logged), logged


def test_a_slow_step_is_logged_with_where_the_engine_thread_was_held(caplog):
    """The slow iteration's warning also names where the engine's thread spent the time (its stack, taken by a
    watching thread while the step ran past the threshold), so the stall can be found, not only seen."""
    with Engine("tiny") as engine:
        schedule = engine.core.scheduler.schedule

        def schedule_slowly():
            if any(r.prompt_len == 5 for r in engine.core.scheduler.waiting):
                time.sleep(0.4)  # (what a slow call does to the step: every request waits)
            return schedule()

        engine.core.scheduler.schedule = schedule_slowly
        with caplog.at_level("WARNING", logger="tandem.engine.core"):
            asyncio.run(engine.generate([9, 8, 7, 6, 5], SamplingParams(max_new_tokens=2, temperature=0)))
        stats = asyncio.run(engine.get_stats())  # (counted in the stats a client reads)
    assert stats.slow_iterations == 1 and 0.4 < stats.slowest_iteration_seconds < 2.0, stats
    logged = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert len(logged) == 1, logged
    assert "held in: schedule_slowly (test_engine_rl.py:" in logged[0] and "< _step (core.py:" in logged[0], logged
