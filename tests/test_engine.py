"""The engine end to end on CPU: against Hugging Face, its batching, prefix cache, sampling and input checks (its RL
controls: test_engine_rl.py)."""

import asyncio
import dataclasses
import functools

import pytest
import torch
from hf_ref import SHAPES, hf_model, tandem_twin

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.kv_pool import KVPool
from tandem.model.attention import PagedAttention, paged_decode_reference
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


def _workload(n):
    ps = prompts(n, 512, 2, 60, seed=4)
    params = [SamplingParams(temperature=0, max_new_tokens=1 + (7 * i) % 23, ignore_eos=True) for i in range(n)]
    return ps, params


@functools.cache
def _alone(n) -> list[list[int]]:
    """Each request of `_workload(n)` run alone, one after another (greedy: the reference both tests below compare
    with, computed once)."""
    with Engine("tiny", EngineConfig(page_size=4, num_pages=512, enable_prefix_cache=False)) as engine:
        return [asyncio.run(engine.generate(p, sp)).output_ids for p, sp in zip(*_workload(n), strict=True)]


def _alone_and_together(config, n=64):
    ps, params = _workload(n)
    alone = _alone(n)
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


def test_one_token_chunks_that_do_not_sample_leave_the_other_rows_tokens_alone():
    """A budget of one prefill token a step: every step is chunks of one token, prompts' chunks that do not
    sample beside decodes that do (or none that do). Each row keeps its own token, as if it ran alone."""
    _alone_and_together(EngineConfig(page_size=4, num_pages=1024, max_prefill_tokens=1), n=8)


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
