"""The engine end to end on CPU: against Hugging Face, and its batching, prefix cache and RL controls."""

import asyncio
import dataclasses
import time

import pytest
import torch
from hf_ref import SHAPES, hf_model, tandem_twin

from tandem.config import EngineConfig
from tandem.engine.engine import Engine, EngineError
from tandem.engine.kv_pool import KVPool
from tandem.model.attention import PackedCausal, PagedAttention, paged_decode_reference
from tandem.model.loader import build_model
from tandem.types import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def prompts(n, vocab, lo=3, hi=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt])
    logprobs = []
    with torch.no_grad():
        for _ in range(n):
            lp = torch.log_softmax(hf(ids).logits[0, -1].float(), -1)
            nxt = int(lp.argmax())
            logprobs.append(lp[nxt].item())
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return ids[0, len(prompt):].tolist(), logprobs


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_paged_decode_logits_match_hf(shape):
    """Prefill in two chunks, then decode token by token through the paged cache; every step's full
    logits equal Hugging Face's on the same sequence."""
    config = SHAPES[shape]
    hf = hf_model(config)
    ours = tandem_twin(hf, config)
    pool = KVPool(config, num_pages=16, page_size=4, dtype=torch.float32, device="cpu")
    pages = [7, 2, 11, 0, 5, 9, 3]  # scattered on purpose
    seq = prompts(1, config.vocab_size, 13, 14)[0] + [5, 6, 7, 8, 9]
    chunks = [(0, 6), (6, 13)] + [(i, i + 1) for i in range(13, len(seq))]
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
        for start, end in chunks:
            slots = pool.slots(pages, 0, end)
            ctx = PagedAttention(pool.k_cache, pool.v_cache, slots[start:], [end - start], [end], [slots])
            hidden = ours(torch.tensor(seq[start:end]), torch.arange(start, end), ctx)
            logits = ours.compute_logits(hidden)
            err = ((logits - ref[start:end]).abs().max() / ref[start:end].abs().max()).item()
            assert err < 1e-4, (start, end, err)


@pytest.mark.parametrize("shape", ["gqa2_tied", "mha_untied"])
def test_greedy_generation_equals_hf(shape):
    config = SHAPES[shape]
    hf = hf_model(config, seed=3)
    with Engine(tandem_twin(hf, config), EngineConfig(page_size=4, num_pages=64)) as engine:
        for prompt in prompts(3, config.vocab_size, seed=3):
            out = asyncio.run(engine.generate(prompt, GREEDY))
            ids, logprobs = hf_greedy(hf, prompt, GREEDY.max_new_tokens)
            assert out.output_ids == ids
            assert out.output_logprobs == pytest.approx(logprobs, abs=1e-4)
            assert out.finish_reason.type == "length" and out.finish_reason.length == 12


def test_prefix_shared_by_three_requests_is_computed_once():
    prefix = prompts(1, 512, 100, 101, seed=1)[0]
    suffixes = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    with Engine("tiny", EngineConfig(page_size=8)) as engine:
        async def go():
            return await asyncio.gather(*[engine.generate(prefix + s, GREEDY) for s in suffixes])

        outs = asyncio.run(go())
        stats = asyncio.run(engine.get_stats())
    computed = sum(o.prefill_tokens for o in outs)
    assert computed == len(prefix) + sum(len(s) for s in suffixes)
    assert stats.prefill_tokens_computed == computed
    assert sorted(o.cached_tokens for o in outs) == [0, len(prefix), len(prefix)]


def test_multi_turn_conversation_prefills_only_new_tokens():
    with Engine("tiny", EngineConfig(page_size=16)) as engine:
        history = prompts(1, 512, 37, 38, seed=2)[0]
        for turn in range(5):
            new = list(range(10 + turn, 20 + 2 * turn))  # "tool output" of growing length
            prompt = history + new
            out = asyncio.run(engine.generate(prompt, GREEDY))
            if turn:
                # everything computed before is reused; the previous turn's last sampled token never went
                # through the model, so it is computed now, with the new tokens
                assert out.cached_tokens == len(history) - 1
                assert out.prefill_tokens == len(new) + 1
            history = prompt + out.output_ids


def _alone_and_together(config, n=64):
    ps = prompts(n, 512, 2, 60, seed=4)
    params = [SamplingParams(temperature=0, max_new_tokens=1 + (7 * i) % 23, ignore_eos=True) for i in range(n)]
    with Engine("tiny", EngineConfig(page_size=4, num_pages=512, enable_prefix_cache=False)) as engine:
        alone = [asyncio.run(engine.generate(p, sp)).output_ids for p, sp in zip(ps, params, strict=True)]
    with Engine("tiny", config) as engine:
        async def go():
            return await asyncio.gather(*[engine.generate(p, sp) for p, sp in zip(ps, params, strict=True)])

        together = asyncio.run(go())
        stats = asyncio.run(engine.get_stats())
    assert [o.output_ids for o in together] == alone
    return together, stats


def test_continuous_batching_equals_running_alone():
    _, stats = _alone_and_together(EngineConfig(page_size=4, num_pages=1024, max_prefill_tokens=64))
    assert stats.num_retractions == 0 and stats.num_steps < 200


def test_holding_admissions_back_changes_no_output():
    _, stats = _alone_and_together(EngineConfig(page_size=4, num_pages=1024, max_prefill_tokens=64,
                                                prefill_delay_steps=3))
    assert stats.waiting_request_steps > 0  # requests did wait


def test_step_counters_count_decode_steps_the_batch_and_the_queue():
    # three requests of 5 prompt tokens and 4 new, at most 2 running: A and B take one prefill step and 3 decode
    # steps while C waits, then C takes 4 steps alone
    with Engine("tiny", EngineConfig(page_size=4, num_pages=64, max_running_requests=2)) as engine:
        async def go():
            await engine.pause("in_place")  # so that all three are queued before the first step
            sp = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
            tasks = [asyncio.create_task(engine.generate(p, sp)) for p in prompts(3, 512, 5, 6)]
            await asyncio.sleep(0)  # the tasks queue their requests
            await engine.resume()
            await asyncio.gather(*tasks)
            return await engine.get_stats()

        stats = asyncio.run(go())
    assert (stats.num_steps, stats.decode_steps, stats.running_request_steps, stats.waiting_request_steps) == \
        (8, 6, 12, 4)


def test_small_kv_pool_retracts_and_still_matches():
    together, stats = _alone_and_together(EngineConfig(page_size=4, num_pages=40, max_prefill_tokens=64))
    assert stats.num_retractions > 0
    assert sum(o.num_retractions for o in together) == stats.num_retractions
    assert stats.pages_free + stats.pages_cached == 40  # nothing leaked


def test_seeded_sampling_is_reproducible_and_batch_independent():
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_new_tokens=16, seed=1234, ignore_eos=True)
    p = prompts(1, 512, seed=5)[0]
    with Engine("tiny") as engine:
        alone = asyncio.run(engine.generate(p, sp))

        async def crowd():
            others = [engine.generate(q, SamplingParams(max_new_tokens=20)) for q in prompts(8, 512, seed=6)]
            return (await asyncio.gather(engine.generate(p, sp), *others))[0]

        crowded = asyncio.run(crowd())
        other_seed = asyncio.run(engine.generate(p, dataclasses.replace(sp, seed=99)))
    assert crowded.output_ids == alone.output_ids
    assert crowded.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
    assert other_seed.output_ids != alone.output_ids


async def _wait_tokens(engine, n):
    while (await engine.get_stats()).generated_tokens < n:
        await asyncio.sleep(0.001)


LONG = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)


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
        insert, load_paused = engine.cache.insert, engine._load_paused
        engine.cache.insert = lambda tokens, pages: inserted.append(len(tokens)) or insert(tokens, pages)

        def counted(*args):  # the inserts made by the update's command (the engine's steps insert prompts too)
            before = len(inserted)
            try:
                return load_paused(*args)
            finally:
                during.extend(inserted[before:])

        engine._load_paused = counted

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


def test_abort_and_cancellation_free_pages():
    with Engine("tiny") as engine:
        async def go():
            a = asyncio.create_task(engine.generate([3, 4, 5], LONG, rid="a"))
            b = asyncio.create_task(engine.generate([6, 7, 8], LONG, rid="b"))
            await _wait_tokens(engine, 6)
            engine.abort("a")
            b.cancel()  # a client that went away
            out = await a
            with pytest.raises(asyncio.CancelledError):
                await b
            await asyncio.sleep(0.05)
            return out, await engine.get_stats()

        out, stats = asyncio.run(go())
    assert out.finish_reason.type == "abort" and 0 < len(out.output_ids) < 60
    assert stats.num_running == 0 and stats.num_queued == 0
    assert stats.pages_free + stats.pages_cached == stats.pages_total


def test_stop_tokens_eos_and_zero_max_new_tokens():
    with Engine("tiny") as engine:
        p = prompts(1, 512, seed=10)[0]
        free = asyncio.run(engine.generate(p, GREEDY))
        stop = free.output_ids[4]
        out = asyncio.run(engine.generate(p, SamplingParams(temperature=0, max_new_tokens=12,
                                                            stop_token_ids=[stop])))
        assert out.output_ids == free.output_ids[:free.output_ids.index(stop) + 1]
        assert out.finish_reason.to_dict() == {"type": "stop", "matched": stop}
        zero = asyncio.run(engine.generate(p, SamplingParams(max_new_tokens=0)))
        assert zero.output_ids == [] and zero.finish_reason.to_dict() == {"type": "length", "length": 0}
    eos_model = build_model("tiny")
    eos_model.config = eos_model.config.with_(eos_token_id=free.output_ids[2])
    with Engine(eos_model) as engine:
        out = asyncio.run(engine.generate(p, SamplingParams(temperature=0, max_new_tokens=12)))
        assert out.finish_reason.type == "stop" and len(out.output_ids) <= 3
        ignored = asyncio.run(engine.generate(p, GREEDY))
        assert ignored.output_ids == free.output_ids


@pytest.mark.parametrize("bad, match", [
    (dict(input_ids=[]), "input_ids: must be a non-empty"),
    (dict(input_ids=[1, 512]), r"input_ids\[1\]: 512 is not a token id"),
    (dict(input_ids=[1, -1]), r"input_ids\[1\]"),
    (dict(input_ids=[1] * 4000, sampling=SamplingParams(max_new_tokens=200)), "exceeds the context length 4096"),
    (dict(input_ids=[1] * 100, sampling=SamplingParams(max_new_tokens=8000)), "exceeds the context length"),
])
def test_bad_requests_raise_value_error_naming_the_field(bad, match):
    with Engine("tiny", EngineConfig(num_pages=64, page_size=4)) as engine:
        with pytest.raises(ValueError, match=match):
            asyncio.run(engine.generate(**bad))
        assert asyncio.run(engine.generate([1, 2, 3], GREEDY)).finish_reason.type == "length"


def test_request_larger_than_kv_pool_is_refused():
    with Engine("tiny", EngineConfig(num_pages=8, page_size=4)) as engine:
        with pytest.raises(ValueError, match="exceeds the KV pool"):
            asyncio.run(engine.generate([1] * 30, SamplingParams(max_new_tokens=10)))


def test_mixed_step_decode_rows_through_a_kernel_equal_the_gather_path():
    """The GPU's mixed steps send decode rows to the paged-decode kernel over block tables; with the reference
    kernel in its place the result must equal the gather path bit for bit (up to float rounding)."""
    config = SHAPES["gqa4_wide_head"]
    model = tandem_twin(hf_model(config), config)
    P = 4
    pool = KVPool(config, num_pages=32, page_size=P, dtype=torch.float32, device="cpu")
    tables = [[3, 7, 1], [0, 2], [9, 4, 5, 6]]
    lens = [10, 6, 13]  # two decodes (q_len 1) around a prefill chunk of 4
    q_lens = [1, 4, 1]
    for table, n in zip(tables, lens, strict=True):
        pool.k_cache[:, pool.slots(table, 0, n)] = torch.randn(config.num_hidden_layers, n, 2, 24)
        pool.v_cache[:, pool.slots(table, 0, n)] = torch.randn(config.num_hidden_layers, n, 2, 24)
    slots = [pool.slots(t, 0, n) for t, n in zip(tables, lens, strict=True)]
    new_slots = torch.cat([s[-q:] for s, q in zip(slots, q_lens, strict=True)])
    ids, positions = torch.randint(0, 300, (6,)), torch.tensor([9, 2, 3, 4, 5, 12])
    outs = []
    for kernel in (None, paged_decode_reference):
        ctx = PagedAttention(pool.k_cache.clone(), pool.v_cache.clone(), new_slots, q_lens, lens, slots)
        if kernel is not None:
            ctx.decode_kernel, ctx.page_size = kernel, P
            ctx.decode_block_table = torch.tensor([[3, 7, 1, 0], [9, 4, 5, 6]], dtype=torch.int32)
        with torch.no_grad():
            outs.append(model(ids, positions, ctx))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
