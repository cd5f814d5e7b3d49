"""The mixture-of-experts kernels (`tandem.kernels.moe.fused_experts` against `Qwen3Experts.reference`, the
routing's `tandem.kernels.moe_routing` against `route` and the sort).

Without CUDA the kernel runs under Triton's CPU interpreter, so those cases stay tiny (hidden and intermediate
sizes that are not powers of two and not multiples of a block, tiles of one expert that spill into a second);
the `gpu` cases run Qwen3-30B-A3B's expert shape, a CUDA-graph replay, and the `tiny-moe` preset through the
engine. fp32 must agree to rounding; bf16 and fp16 within an ulp or two of the output's scale (the reference rounds
after each expert's `index_add_`, the kernel once after its sum over the k slots).
"""

import asyncio
import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so before the import
pytest.importorskip("triton")

from tandem.config import PRESETS, EngineConfig  # noqa: E402
from tandem.engine.engine import Engine  # noqa: E402
from tandem.kernels import moe as moe_kernels  # noqa: E402
from tandem.kernels.moe import _tiles, fused_experts  # noqa: E402
from tandem.kernels.moe_routing import route_topk  # noqa: E402
from tandem.model.attention import PackedCausal  # noqa: E402
from tandem.model.loader import build_model  # noqa: E402
from tandem.model.moe import Qwen3Experts, route  # noqa: E402
from tandem.model.qwen3 import Qwen3ForCausalLM  # noqa: E402
from tandem.types import SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def make_experts(E, H, inter, dtype, seed=0) -> Qwen3Experts:
    config = dataclasses.replace(PRESETS["tiny-moe"], hidden_size=H, num_experts=E, moe_intermediate_size=inter)
    with torch.device(DEVICE):  # (drawn where they live: Qwen3-30B-A3B's experts are 1.2 G parameters a layer)
        experts = Qwen3Experts(config)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    with torch.no_grad():  # scaled so each projection's outputs are of order one
        experts.gate_up_proj.normal_(0, H ** -0.5, generator=gen)
        experts.down_proj.normal_(0, inter ** -0.5, generator=gen)
    return experts.to(dtype)


def distinct_ids(T, k, E, seed=0) -> torch.Tensor:
    """[T, k] expert ids, distinct within each token (as top-k gives them)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :k].to(DEVICE)


def routing_weights(T, k, dtype, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return (0.1 + torch.rand(T, k, generator=gen)).to(DEVICE, dtype)


def check(experts, x, ids, weights):
    """The kernel equals the reference on (x, ids, weights); returns the kernel's output."""
    with torch.no_grad():
        out = fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights)
        want = experts.reference(x, ids, weights)
    assert out.shape == want.shape and out.dtype == want.dtype, (out.shape, want.shape, out.dtype, want.dtype)
    assert torch.isfinite(out).all()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    else:  # a couple of ulps of the output's scale (bf16 has 8 significant bits, fp16 11)
        ulp = 2.0 ** -7 if out.dtype == torch.bfloat16 else 2.0 ** -10
        scale = max(want.abs().max().item() if want.numel() else 0.0, 1.0)
        torch.testing.assert_close(out.float(), want.float(), rtol=2 * ulp, atol=2 * ulp * scale)
    return out


def randn(*shape, dtype, seed=2):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


# ---------------------------------------------------------------------------------------------------- CPU (interp)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,E,k,H,inter", [
    (0, 4, 2, 32, 32),  # no tokens
    (1, 4, 2, 32, 32),
    (7, 5, 2, 40, 36),  # H and I not powers of two, each under one block
    (5, 3, 2, 72, 52),  # H and I past a block, tails masked in both kernels
    (37, 5, 3, 24, 20),  # about 22 pairs per expert: tiles of one expert spill into a second
])
def test_kernel_equals_reference(T, E, k, H, inter, dtype):
    experts = make_experts(E, H, inter, dtype, seed=T)
    check(experts, randn(T, H, dtype=dtype), distinct_ids(T, k, E, seed=T), routing_weights(T, k, dtype, seed=T))


def test_one_token_hits_every_expert_and_the_weights_scale_each():
    """k == E: one token's output sums all experts' outputs, each scaled by its own weight (0 drops one)."""
    E, H, inter = 4, 24, 20
    experts = make_experts(E, H, inter, torch.float32, seed=3)
    x = randn(1, H, dtype=torch.float32)
    ids = torch.tensor([[2, 0, 3, 1]], device=DEVICE)
    out = check(experts, x, ids, torch.tensor([[0.5, 1.0, 2.0, 0.0]], device=DEVICE))
    parts = [check(experts, x, torch.tensor([[e]], device=DEVICE), torch.ones(1, 1, device=DEVICE))
             for e in range(E)]
    torch.testing.assert_close(out, 1.0 * parts[0] + 0.5 * parts[2] + 2.0 * parts[3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_token_routed_to_one_expert(dtype):
    """Imbalance: all 40 tokens in one expert (three tiles), the other slot spread over the rest."""
    T, E, H, inter = 40, 6, 24, 20
    experts = make_experts(E, H, inter, dtype, seed=4)
    ids = torch.stack([torch.full((T,), 4), torch.arange(T) % 4], dim=1).to(DEVICE)
    check(experts, randn(T, H, dtype=dtype), ids, routing_weights(T, 2, dtype))
    check(experts, randn(T, H, dtype=dtype), ids[:, :1], routing_weights(T, 1, dtype))  # k = 1: one expert only


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_another_ranks_experts_contribute_nothing(dtype):
    """Expert parallelism: ids outside [0, E) are another rank's; a token with none of its experts here gets
    zeros, and the others only their local experts' share."""
    T, E, k, H, inter = 6, 3, 2, 24, 20
    experts = make_experts(E, H, inter, dtype, seed=5)
    x = randn(T, H, dtype=dtype)
    ids = torch.tensor([[0, 3], [-1, 2], [7, -6], [1, 0], [3, 4], [2, -1]], device=DEVICE)
    weights = routing_weights(T, k, dtype)
    out = check(experts, x, ids, weights)
    assert not out[[2, 4]].any(), "a token routed only to another rank's experts"
    local_only = torch.where((ids >= 0) & (ids < E), ids, 0)
    kept = torch.where((ids >= 0) & (ids < E), weights, 0)  # (a zero weight: the local expert adds nothing)
    with torch.no_grad():
        torch.testing.assert_close(out, fused_experts(x, experts.gate_up_proj, experts.down_proj, local_only, kept))


def test_fp16_and_a_strided_input():
    T, E, k, H, inter = 9, 4, 2, 40, 36
    experts = make_experts(E, H, inter, torch.float16, seed=6)
    x = randn(T, H + 8, dtype=torch.float16)[:, :H]  # rows of a wider buffer
    check(experts, x, distinct_ids(T, k, E, seed=6), routing_weights(T, k, torch.float16))


def test_deterministic():
    T, E, k, H, inter = 37, 5, 3, 24, 20
    experts = make_experts(E, H, inter, torch.bfloat16, seed=7)
    args = (randn(T, H, dtype=torch.bfloat16), experts.gate_up_proj.data, experts.down_proj.data,
            distinct_ids(T, k, E, seed=7), routing_weights(T, k, torch.bfloat16))
    assert torch.equal(fused_experts(*args), fused_experts(*args))


@pytest.mark.parametrize("grouping", ["as chosen", "one launch", "sorted"])
@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("T,E,k", [(1, 128, 8), (300, 8, 2), (50, 3, 3), (64, 128, 8)])
def test_tiles_hold_each_local_pair_once(T, E, k, block_m, grouping, monkeypatch):
    """The grouping at every tile height the GPU uses (the interpreter runs only 16), by each of its ways (a tile
    per pair, one launch, sorting): each pair of a local expert in exactly one tile, of that expert and at most
    block_m tall, the tiles in use first and of experts in order; another rank's pairs in none; `order` a
    permutation of the pairs."""
    if grouping != "as chosen":
        monkeypatch.setattr(moe_kernels, "PAIR_TILES_UPTO", 0)
    if grouping == "sorted":
        monkeypatch.setattr(moe_kernels, "GROUP_IN_ONE_LAUNCH_UPTO", 0)
    gen = torch.Generator().manual_seed(T)
    ids = torch.randint(-3, E + 3, (T, k), generator=gen).to(DEVICE)
    ids[: T // 2, 0] = E - 1  # imbalance
    order, tiles = _tiles(ids, E, block_m)
    order, tiles, ids = order.cpu().long(), tiles.cpu(), ids.cpu()
    assert tiles.shape == (3, T * k // block_m + min(E, T * k))
    assert sorted(order.tolist()) == list(range(T * k))
    seen = torch.zeros(T * k, dtype=torch.int64)
    for expert, first, end in tiles.T.tolist():
        assert 0 <= end - first <= block_m
        rows = order[first:end]
        assert (ids.reshape(-1)[rows] == expert).all()
        seen[rows] += 1
    local = (ids >= 0) & (ids < E)
    assert torch.equal(seen, local.reshape(-1).long())
    used = tiles[2] > tiles[1]
    assert not used[used.sum():].any(), "the tiles in use come first"
    if grouping != "as chosen" or T * k > moe_kernels.PAIR_TILES_UPTO:
        assert torch.equal(tiles[0, used], tiles[0, used].sort().values), "tiles in expert order"


@pytest.mark.parametrize("T,E,k,normalize", [(1, 128, 8, True), (37, 60, 4, False), (20, 3, 3, True)])
def test_route_kernel_equals_route(T, E, k, normalize):
    """The router's top-k in one kernel: the same experts in the same order as `route`, and its weights within
    fp32's last bits (its exponential and its sum's order are not PyTorch's)."""
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T)).to(DEVICE)
    weights, ids = route_topk(logits, k, normalize)
    want_weights, want_ids = route(logits, k, normalize)
    assert ids.dtype == want_ids.dtype and torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=4e-7, atol=1e-7)


def test_route_kernel_takes_the_lowest_expert_among_equal_logits():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 1.0]], device=DEVICE)
    weights, ids = route_topk(logits, 4, normalize=False)
    assert ids.tolist() == [[1, 3, 2, 4]]
    torch.testing.assert_close(weights, torch.softmax(logits, -1)[:, [1, 3, 2, 4]])


@pytest.mark.parametrize("lens", [[5, 3], [13, 9]], ids=["small-rows", "wide"])
def test_use_fused_kernels_runs_the_experts_through_the_kernel(lens):
    """The model's fused path (`use_fused_kernels`) on a MoE model equals its reference path, through the kernel,
    with few rows (`_forward_small`) and more."""
    config = dataclasses.replace(PRESETS["tiny-moe"], vocab_size=128, hidden_size=48, moe_intermediate_size=40)
    model = Qwen3ForCausalLM(config).to(DEVICE).init_random(0)
    ids = torch.randint(0, config.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    with torch.no_grad():
        want = model(ids, positions, PackedCausal(lens))
        model.use_fused_kernels()
        assert model.moe_blocks and all(b.experts.kernel is fused_experts and b.route_kernel is route_topk
                                        for b in model.moe_blocks)
        out = model(ids, positions, PackedCausal(lens))
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------------------ GPU


QWEN3_30B = PRESETS["qwen3-30b-a3b"]


def realistic_experts(E_local=128):
    """Qwen3-30B-A3B's experts (H 2048, I 768) in bf16; E_local of its 128."""
    return make_experts(E_local, QWEN3_30B.hidden_size, QWEN3_30B.moe_intermediate_size, torch.bfloat16)


def realistic_routing(T, first=0, seed=0):
    """(x, local ids, weights) of T tokens routed by a router's top-8 of 128, for the rank whose experts start
    at `first`."""
    x = randn(T, QWEN3_30B.hidden_size, dtype=torch.bfloat16, seed=seed)
    logits = randn(T, QWEN3_30B.num_experts, dtype=torch.bfloat16, seed=seed + 1)
    weights, ids = route(logits, QWEN3_30B.num_experts_per_tok, normalize=True)
    return x, ids - first, weights


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 300])
def test_kernel_equals_reference_at_qwen3_30b_shape_gpu(T):
    check(realistic_experts(), *realistic_routing(T))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 300])
def test_route_kernel_at_qwen3_30b_shape_gpu(T):
    """bf16 router logits of 128 experts, top 8: the same weights as `route`, and the same experts in every row
    whose 8th and 9th largest logits differ (equal ones may be taken in another order, or the other one)."""
    logits = randn(T, QWEN3_30B.num_experts, dtype=torch.bfloat16, seed=T)
    k = QWEN3_30B.num_experts_per_tok
    weights, ids = route_topk(logits, k, normalize=True)
    want_weights, want_ids = route(logits, k, normalize=True)
    torch.testing.assert_close(weights.float(), want_weights.float(), rtol=2 ** -7, atol=0)
    top = logits.float().topk(k + 1, dim=-1).values
    clear = top[:, k - 1] > top[:, k]
    assert clear.float().mean() > 0.5
    assert torch.equal(ids[clear].sort(-1).values, want_ids[clear].sort(-1).values)


@pytest.mark.gpu
def test_kernel_is_deterministic_whatever_order_the_grouping_atomics_take_gpu():
    """The one-launch grouping places an expert's pairs in the order its atomics ran, which varies from run to
    run; no output may depend on it (an imbalanced step: many pairs an expert, tiles spilling into others)."""
    experts, (x, ids, weights) = realistic_experts(), realistic_routing(256)
    ids[:128, :4] = torch.arange(4, device=DEVICE)  # half the tokens share four experts in their first slots
    with torch.no_grad():
        first = fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights)
        orders = set()
        for _ in range(20):
            order, _ = moe_kernels._tiles(ids, experts.num_local, 16)
            orders.add(tuple(order.tolist()))
            assert torch.equal(fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights), first)
    print(f"{len(orders)} distinct orders of the pairs in 20 groupings")


@pytest.mark.gpu
def test_kernel_drops_other_ranks_experts_gpu():
    check(realistic_experts(E_local=32), *realistic_routing(300, first=64))  # rank 2 of 4


@pytest.mark.gpu
def test_kernel_replays_in_a_cuda_graph_on_new_routing():
    """Captured once, replayed on other tokens and routings written into the captured buffers (the routing is
    never read on the host)."""
    experts, (x, ids, weights) = realistic_experts(), realistic_routing(64)
    with torch.no_grad():
        fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights)
        for seed in (1, 2):
            new_x, new_ids, new_weights = realistic_routing(64, seed=seed)
            new_ids[:32] = 5  # an imbalanced step: half the tokens' every slot on one expert
            x.copy_(new_x)
            ids.copy_(new_ids)
            weights.copy_(new_weights)
            graph.replay()
            want = check(experts, x, ids, weights)
            assert torch.equal(out, want)


@pytest.mark.gpu
def test_tiny_moe_engine_with_graphs_and_kernels_generates_the_reference_tokens():
    """fp32 `tiny-moe` on CUDA: CUDA graphs (decode and mixed steps, the experts' kernel inside them) and fused
    kernels give the same greedy tokens as the engine with fused kernels off (the reference experts' loop)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (int(n),), generator=gen).tolist() for n in torch.randint(3, 60, (12,),
                                                                                              generator=gen)]
    greedy = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    outs = []
    for fused in (True, False):
        model = build_model("tiny-moe", device="cuda", seed=1)
        config = EngineConfig(device="cuda", cuda_graphs=True, fused_kernels=fused, page_size=16, num_pages=256,
                              max_running_requests=16, max_prefill_tokens=64)  # (chunked prefill beside decodes)
        with Engine(model, config) as engine:
            if fused:
                assert all(b.experts.kernel is fused_experts for b in engine.model.moe_blocks)
                assert engine.core.runner.graphs, "decode should replay CUDA graphs"
                assert engine.core.runner.mixed_graphs, "steps that prefill should replay CUDA graphs"

            async def go():
                return await asyncio.gather(*[engine.generate(p, greedy) for p in prompts])

            outs.append(asyncio.run(go()))
    for f, r in zip(*outs, strict=True):
        assert f.output_ids == r.output_ids
        assert f.output_logprobs == pytest.approx(r.output_logprobs, abs=1e-3)
