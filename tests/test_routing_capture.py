"""Rollout routing replay, the engine's half: every token's experts, kept beside its KV and returned on request, equal
the routing a whole-sequence forward takes; cached prefixes come with the routing of when they were computed, and
chunked prefill, batches, retraction and multi-turn resubmission keep one row per token, in order. Over HTTP in
SGLang's form (`meta_info.routed_experts`: base64 of an int32 array [tokens - 1, layers, top-k])."""

import asyncio
import base64
import dataclasses

import httpx
import numpy as np
import pytest
import torch

from tandem.config import PRESETS, EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.kv_pool import KVPool
from tandem.engine.request import Outbox
from tandem.model import moe
from tandem.model.attention import PackedCausal
from tandem.server.http import ServerThread
from tandem.types import SamplingParams

MODEL = PRESETS["tiny-moe"]  # 3 layers, the first dense; 6 experts, 2 a token
CONFIG = EngineConfig(page_size=4, num_pages=64, enable_return_routed_experts=True)
SAMPLING = SamplingParams(max_new_tokens=9, temperature=0.9, seed=2, ignore_eos=True)


def reference_routing(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), layers, k] of one forward over the whole sequence (-1 in dense layers)."""
    rows = torch.full((len(tokens), MODEL.num_hidden_layers, MODEL.num_experts_per_tok), -1, dtype=torch.int16)
    original = moe.route

    def recording(logits, k, normalize, recorded=None):
        weights, ids = original(logits, k, normalize, recorded)
        rows[:, layer.pop(0)] = ids.to(torch.int16).cpu()
        return weights, ids
    layer = [b.layer for b in model.moe_blocks]
    device = next(model.parameters()).device
    kernels = [b.route_kernel for b in model.moe_blocks]  # (the GPU's fused routing bypasses `moe.route`)
    moe.route = recording
    try:
        for block in model.moe_blocks:
            block.route_kernel = None
        with torch.no_grad():
            model(torch.tensor(tokens, device=device), torch.arange(len(tokens), device=device),
                  PackedCausal([len(tokens)]))
    finally:
        moe.route = original
        for block, kernel in zip(model.moe_blocks, kernels, strict=True):
            block.route_kernel = kernel
    return rows


def prompt(n, seed=0):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("config", [CONFIG, dataclasses.replace(CONFIG, max_prefill_tokens=5, num_pages=12)],
                         ids=["whole prefill", "chunked prefill, a pool that forces retraction"])
def test_every_token_comes_with_the_experts_a_whole_sequence_forward_routes_it_to(config):
    async def go():
        with Engine("tiny-moe", config) as engine:
            await engine.pause("in_place")  # all four queued before the first step, so the small pool must retract
            prompts = [prompt(17, seed=i) for i in range(4)]
            tasks = [asyncio.create_task(engine.generate(p, SAMPLING, return_routed_experts=True)) for p in prompts]
            await asyncio.sleep(0)  # the tasks queue their requests
            await engine.resume()
            outs = await asyncio.gather(*tasks)
            for p, out in zip(prompts, outs, strict=True):
                tokens = p + out.output_ids
                assert out.routed_experts.shape == (len(tokens) - 1, 3, 2)
                assert torch.equal(out.routed_experts, reference_routing(engine.model, tokens)[:-1])
                assert (out.routed_experts[:, 0] == -1).all()  # the dense layer
            return sum(o.num_retractions for o in outs)
    retractions = asyncio.run(go())
    assert retractions > 0 or config is CONFIG  # (the small pool does retract)


def test_a_later_turn_gets_its_cached_prefix_routing_as_it_was_computed():
    """The second turn's history is served from the cache: its rows for the history are the first turn's rows (the
    routing kept beside the cached KV, not recomputed), and the rest equal a whole-sequence forward."""
    async def go():
        with Engine("tiny-moe", CONFIG) as engine:
            first_prompt = prompt(21, seed=7)
            first = await engine.generate(first_prompt, SAMPLING, return_routed_experts=True)
            history = first_prompt + first.output_ids + prompt(6, seed=8)
            second = await engine.generate(history, SAMPLING, return_routed_experts=True)
            assert second.cached_tokens >= 24
            shared = len(first_prompt) + len(first.output_ids) - 1
            assert torch.equal(second.routed_experts[:shared], first.routed_experts)
            assert torch.equal(second.routed_experts, reference_routing(engine.model, history + second.output_ids)[:-1])
            plain = await engine.generate(history, SAMPLING)
            assert plain.routed_experts is None  # only when asked for
    asyncio.run(go())


def test_routing_moves_with_its_pages_through_the_host_tier():
    """A pool too small for the history: it goes to the host tier and comes back for the later turn, its routing
    with it (the rows of the history as first computed, and host-loaded tokens among them)."""
    config = dataclasses.replace(CONFIG, num_pages=10, host_cache="write_through", host_cache_pages=64)

    async def go():
        with Engine("tiny-moe", config) as engine:
            first_prompt = prompt(19, seed=11)
            first = await engine.generate(first_prompt, SAMPLING, return_routed_experts=True)
            for i in range(3):  # other requests push the history's pages off the device
                await engine.generate(prompt(25, seed=20 + i), SAMPLING)
            history = first_prompt + first.output_ids + prompt(3, seed=12)
            second = await engine.generate(history, SAMPLING, return_routed_experts=True)
            assert second.host_cached_tokens > 0, second
            shared = second.cached_tokens
            assert torch.equal(second.routed_experts[:shared], first.routed_experts[:shared])
            assert torch.equal(second.routed_experts, reference_routing(engine.model, history + second.output_ids)[:-1])
    asyncio.run(go())


def test_a_falsifier_routing_not_kept_with_the_cache_would_be_caught():
    """If the cached positions' routing were not kept (here: wiped between the turns, as a capture that skipped
    cached pages would leave them), the later turn's rows for its history would not be the routing: -1."""
    async def go():
        with Engine("tiny-moe", CONFIG) as engine:
            first_prompt = prompt(21, seed=7)
            first = await engine.generate(first_prompt, SAMPLING, return_routed_experts=True)
            engine.pool.routing.fill_(-1)  # (the engine is idle)
            second = await engine.generate(first_prompt + first.output_ids, SAMPLING, return_routed_experts=True)
            assert not torch.equal(second.routed_experts[:len(first.routed_experts)], first.routed_experts)
    asyncio.run(go())


def test_over_http_in_sglangs_form_and_clear_errors():
    with Engine("tiny-moe", CONFIG) as engine, ServerThread(engine) as server:
        prompts = [prompt(13, seed=3), prompt(9, seed=4)]
        r = httpx.post(f"{server.url}/generate", json={"input_ids": prompts, "return_routed_experts": [True, False],
                                                        "sampling_params": {"max_new_tokens": 5, "seed": 1}})
        assert r.status_code == 200, r.text
        first, second = r.json()
        tokens = prompts[0] + first["output_ids"]
        routed = np.frombuffer(base64.b64decode(first["meta_info"]["routed_experts"].encode("ascii")),
                               dtype=np.int32).reshape(len(tokens) - 1, MODEL.num_hidden_layers,
                                                       MODEL.num_experts_per_tok)
        assert torch.equal(torch.from_numpy(routed.copy()), reference_routing(engine.model, tokens)[:-1].int())
        assert "routed_experts" not in second["meta_info"]
        r = httpx.post(f"{server.url}/generate", json={"input_ids": prompts, "return_routed_experts": [True]})
        assert r.status_code == 400 and "return_routed_experts" in r.text
    with Engine("tiny", EngineConfig(page_size=4, num_pages=16)) as dense, ServerThread(dense) as server:
        r = httpx.post(f"{server.url}/generate", json={"input_ids": [1, 2], "return_routed_experts": True,
                                                        "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 400 and "keeps no routing" in r.text
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        Engine("tiny", dataclasses.replace(CONFIG))


class Copy:
    """A stand-in for a copy's CUDA event: done when told."""

    def __init__(self):
        self.done = self.waited = False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = True


def test_an_output_waits_for_its_routings_copy_unless_no_step_is_left_to_overlap_the_wait():
    """`Outbox`: an output whose routed experts are still being copied to the host is held back (the engine goes on
    stepping) until its copy is done; the others pass it; with nothing left to overlap it is waited for."""
    box, copies = Outbox(), [Copy(), Copy()]
    box.put("a", copies[0])
    box.put("b")
    box.put("c", copies[1])
    assert box.take(wait=False) == ["b"] and not copies[0].waited
    copies[1].done = True
    assert box.take(wait=False) == ["c"]
    assert box.take(wait=True) == ["a"] and copies[0].waited
    assert box.take(wait=True) == []


@pytest.mark.gpu
def test_a_finishing_requests_routing_reaches_the_host_without_waiting_for_the_step_in_flight():
    """`KVPool.read_routing` (what a finishing request that asked for its routed experts reads) returns while the
    work queued before it (the step in flight; here a sleep of about a second) still runs, and its pinned rows are
    the routing once its event has completed."""
    pool = KVPool(MODEL, 8, 4, torch.bfloat16, torch.device("cuda"), routing=True)
    pool.routing.copy_(torch.randint(0, 6, pool.routing.shape, dtype=torch.int16))
    pages = [5, 2, 7]
    want = pool.routing[pool.slots(pages, 0, 10)].cpu()
    torch.cuda._sleep(2_000_000_000)  # (clock cycles)
    rows, copied = pool.read_routing(pages, 10)
    assert not torch.cuda.current_stream().query(), "the host waited for the queued work"
    assert rows.is_pinned() and not copied.query()
    copied.synchronize()
    assert torch.equal(rows, want)


@pytest.mark.gpu
def test_on_the_gpu_the_graphs_capture_the_routing_too():
    """On CUDA, decode steps replay CUDA graphs with the routing's writes inside them, the experts through the fused
    kernel: the rows still equal a whole-sequence forward's (of the same fused model), but for rare near-ties."""
    config = dataclasses.replace(CONFIG, device="cuda", num_pages=256)

    async def go():
        with Engine("tiny-moe", config) as engine:
            assert engine.runner.graphs
            prompts = [prompt(30, seed=i) for i in range(8)]
            outs = await asyncio.gather(*[engine.generate(p, SAMPLING, return_routed_experts=True) for p in prompts])
            same = total = 0
            for p, out in zip(prompts, outs, strict=True):
                want = reference_routing(engine.model, p + out.output_ids)[:-1]
                same += int((out.routed_experts == want).all(dim=(1, 2)).sum())
                total += len(want)
            assert same >= 0.98 * total, (same, total)
    asyncio.run(go())


@pytest.mark.parametrize("by_reference", [False, True], ids=["as bytes", "by reference"])
def test_routing_moves_with_the_kv_from_a_prefill_to_a_decode_engine(by_reference):
    """Prefill/decode: the prefill engine exports the routing of the positions it sends with their KV, the decode
    engine keeps it beside them; the decode engine's answer then carries every token's routing (a later turn's
    history from its own cache), whether the KV came as bytes or by reference (the pool mapped, the pages pinned);
    pairing a decode engine that keeps routing with one that does not is refused."""
    from tandem.engine.kv_mapped import MappedKV, MappedPool, pool_handle
    from tandem.server.disagg import kv_layout

    prefill_config = dataclasses.replace(CONFIG, role="prefill")
    decode_config = dataclasses.replace(CONFIG, role="decode")

    async def go():
        with Engine("tiny-moe", prefill_config) as p, Engine("tiny-moe", decode_config) as d:
            history = prompt(23, seed=5)
            for _ in range(2):
                kv_from = await d.probe(history)
                first = await p.generate(history, dataclasses.replace(SAMPLING, max_new_tokens=1),
                                         export_kv_from=kv_from, export_pinned=by_reference)
                assert first.kv.routing.shape == (len(history) - kv_from, 3, 2)
                kv = first.kv if not by_reference else MappedKV(
                    MappedPool(pool_handle(p.pool), d.pool.k_cache.device), first.kv.handle, "prefill-here", "e")
                out = await d.generate_imported(history, SAMPLING, (first.output_ids, first.output_logprobs,
                                                                    first.weight_versions), kv,
                                                return_routed_experts=True)
                if by_reference:
                    assert kv.checked and kv.failure is None
                    first.kv.free(True)
                assert torch.equal(out.routed_experts, reference_routing(d.model, history + out.output_ids)[:-1])
                history = history + out.output_ids + prompt(5, seed=6)
            assert kv_from > 0  # (the later turn's history came from the decode engine's cache)
            with Engine("tiny-moe", dataclasses.replace(prefill_config, enable_return_routed_experts=False)) as bare:
                assert kv_layout(bare)["routed_experts"] != kv_layout(d, "prefill")["routed_experts"]
    asyncio.run(go())
