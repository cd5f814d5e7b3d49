"""Rollout routing replay (R3) in the trainer. Episodes keep the engine's routing, one row per token (-1 where it
computed nothing), in process and over HTTP. The rollout side here routes differently from the trainer on purpose
(experts picked from biased router probabilities; engine and trainer both float32 on a CPU, on the same weights): with
replay the trainer sends every recorded token-layer to the rollout's experts, reproduces the engine's logprobs, and
still trains its routers; tokens without a row route live; the step does not depend on packing, checkpointing or
FSDP2 over 2 gloo ranks. Without replay the routing and the logprobs disagree (the falsifier), as they do when the
recorded experts are shuffled; with identical numerics on both sides replay changes nothing. `tandem run
trainer.routing_replay=true` records the metrics."""

import asyncio
import contextlib
import copy
import dataclasses
import datetime
import json
import math

import pytest
import torch
import torch.distributed as dist
from test_moe_training import gradients
from test_routing_capture import reference_routing
from test_transport import free_port, run_pair
from torch.distributed.tensor import DTensor

from tandem.config import PRESETS, EngineConfig, LossConfig, RandomAgentConfig, RunConfig, TrainerConfig
from tandem.engine.client import EngineClient, parse_output
from tandem.engine.engine import Engine
from tandem.model import moe
from tandem.model.loader import build_model
from tandem.rollout.agent import run_episode
from tandem.rollout.random_agent import RandomAgentEnv
from tandem.server.http import ServerThread
from tandem.trainer import replay
from tandem.trainer.trainer import Trainer
from tandem.types import Episode, Group, SamplingParams

MODEL = PRESETS["tiny-moe"]  # 3 layers, the first dense; 6 experts, 2 a token
MOE_LAYERS = [i for i in range(MODEL.num_hidden_layers) if MODEL.is_sparse(i)]
ENGINE = EngineConfig(page_size=4, num_pages=256, enable_return_routed_experts=True)
AGENT = RandomAgentConfig(prompt_len_min=8, prompt_len_max=24, turns_min=1, turns_max=3, response_len_median=6,
                          response_len_max=12, obs_ratio=1.0, obs_len_max=8, max_context=96)
BIAS_E = torch.tensor([0.3, 0.18, 0.06, -0.06, -0.18, -0.3])  # the rollout side's preference, on log-probabilities
METRICS = ("routing_disagreement", "routing_disagreement_tokens", "mismatch_k3", "mismatch_ratio_beyond_2")
MICRO = 48


def policy():
    """The tiny MoE model with routing that matters: sharper routers, stronger experts and a sharper head than the
    random initialisation's (whose experts barely move the logits)."""
    model = build_model("tiny-moe", dtype="float32", seed=0)
    with torch.no_grad():
        for block in model.moe_blocks:
            block.gate.weight.mul_(5)
            block.experts.down_proj.mul_(30)
        model.lm_head.weight.mul_(10)
    return model


def make_trainer(**cfg) -> Trainer:
    return Trainer(policy(), TrainerConfig(**dict(micro_batch_tokens=4096) | cfg), LossConfig())


def biased_route(logits_TE, k, normalize, recorded_TK=None):
    """The rollout side's routing: experts from the biased probabilities, weighted as replay weights them."""
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    ids_TK = torch.topk(probs_TE.log() + BIAS_E, k, dim=-1).indices
    weights_TK = probs_TE.gather(-1, ids_TK)
    if normalize:
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    return weights_TK.to(logits_TE.dtype), ids_TK


@contextlib.contextmanager
def patched_route(fn):
    original, moe.route = moe.route, fn
    try:
        yield
    finally:
        moe.route = original


async def play(client, first_seed: int, num_groups: int = 2, group_size: int = 3) -> list[Group]:
    groups = []
    for g in range(num_groups):
        episodes = [Episode(f"{first_seed + g}-{j}", g, reward=float(j)) for j in range(group_size)]
        await asyncio.gather(*[run_episode(client, RandomAgentEnv(AGENT, MODEL.vocab_size, first_seed + g, j), e,
                                           AGENT.max_context, routing=True) for j, e in enumerate(episodes)])
        groups.append(Group(g, episodes, 0))
    return groups


@pytest.fixture(scope="module")
def rollouts() -> dict[str, list[Group]]:
    """Multi-turn episodes of one engine: "biased" where it routes by `biased_route`, "plain" where it routes as the
    trainer does."""
    async def go():
        with Engine(policy(), ENGINE) as engine:
            with patched_route(biased_route):
                biased = await play(engine, 100)
            return {"biased": biased, "plain": await play(engine, 200)}
    return asyncio.run(go())


def batch(groups: list[Group], change=None) -> list[Group]:
    """A copy of `groups` (a step must not see another's episodes), `change(episode)` applied to each."""
    groups = copy.deepcopy(groups)
    for e in (e for g in groups for e in g.episodes):
        if change is not None:
            change(e)
    return groups


def last_policy_token(e: Episode) -> int:
    return max(i for i, m in enumerate(e.loss_mask) if m)


@contextlib.contextmanager
def recording(trainer: Trainer):
    """Per MoE layer, the experts the trainer's forwards send the tokens to ("used") and those its routers pick
    ("live"), each forward's rows appended."""
    used, live, hooks = {}, {}, []
    for block in trainer.model.moe_blocks:
        used[block.layer], live[block.layer] = [], []
        hooks.append(block.experts.register_forward_pre_hook(
            lambda _, args, out=used[block.layer]: out.append(args[1].detach().clone())))
        hooks.append(block.gate.register_forward_hook(
            lambda _, __, logits, out=live[block.layer], k=block.top_k: out.append(
                torch.topk(torch.softmax(logits.detach(), -1, dtype=torch.float32), k).indices)))
    try:
        yield used, live
    finally:
        for hook in hooks:
            hook.remove()


# ---- episodes carry the routing ------------------------------------------------------------------------------------


def test_episodes_keep_a_row_per_token_as_the_engine_routed_it_and_minus_one_where_it_computed_nothing(rollouts):
    model = policy()
    for e in (e for g in rollouts["plain"] for e in g.episodes):
        assert e.routed_experts.shape == (len(e.tokens), MODEL.num_hidden_layers, MODEL.num_experts_per_tok)
        assert e.routed_experts.dtype == torch.int16
        end = last_policy_token(e)  # the last generate computed every token before its last one
        assert torch.equal(e.routed_experts[:end], reference_routing(model, e.tokens)[:end]), e.episode_id
        assert (e.routed_experts[:end, MOE_LAYERS] >= 0).all() and (e.routed_experts[end:] == -1).all()
    assert any(e.num_turns > 1 for g in rollouts["plain"] for e in g.episodes)  # tool output inside, computed


def test_through_a_host_tier_the_rows_are_the_same():
    """A small device pool whose cached histories go to the host tier and come back: the rows are still the routing
    a whole-sequence forward takes."""
    config = dataclasses.replace(ENGINE, num_pages=24, host_cache="write_through")

    async def go():
        with Engine(policy(), config) as engine:
            groups = await play(engine, 300, num_groups=3)
            return groups, (await engine.get_stats()).host_pages_loaded
    groups, loaded = asyncio.run(go())
    assert loaded > 0
    model = policy()
    for e in (e for g in groups for e in g.episodes):
        end = last_policy_token(e)
        assert torch.equal(e.routed_experts[:end], reference_routing(model, e.tokens)[:end]), e.episode_id


def test_keep_routing_takes_the_latest_rows_and_keeps_earlier_ones_beyond_them():
    """An aborted request may return fewer rows than the history it was given: the earlier rows stay."""
    e = Episode("e", 0)
    e.add([1, 2, 3, 4], policy=False)
    e.keep_routing(torch.full((3, 2, 1), 7, dtype=torch.int16))
    e.add([5, 6], policy=True, logprobs=[0.0, 0.0], versions=[0, 0])
    e.keep_routing(torch.full((2, 2, 1), 8, dtype=torch.int16))
    e.add([9], policy=False)
    e.keep_routing()
    assert e.routed_experts[:, 0, 0].tolist() == [8, 8, 7, -1, -1, -1, -1]


def test_over_http_the_client_decodes_the_routing_the_engine_returns():
    sampling = SamplingParams(max_new_tokens=6, seed=3, ignore_eos=True)
    prompt = list(range(40, 57))

    async def go():
        with Engine("tiny-moe", ENGINE) as engine, ServerThread(engine) as server:
            direct = await engine.generate(prompt, sampling, return_routed_experts=True)
            client = EngineClient(server.url).connect()
            try:
                over_http = await client.generate(prompt, sampling, return_routed_experts=True)
                plain = await client.generate(prompt, sampling)
            finally:
                await client.aclose()
        assert over_http.output_ids == direct.output_ids and over_http.routed_experts.dtype == torch.int16
        assert torch.equal(over_http.routed_experts, direct.routed_experts)
        assert plain.routed_experts is None
    asyncio.run(go())
    with pytest.raises(ValueError, match="model's config"):
        parse_output({"output_ids": [], "meta_info": {"id": "r", "finish_reason": {"type": "length"},
                                                      "prompt_tokens": 1, "cached_tokens": 0, "routed_experts": ""}})


# ---- replay ----------------------------------------------------------------------------------------------------------


def test_replay_routes_every_recorded_token_layer_as_the_rollout_did_and_the_rest_live(rollouts):
    """The rollout routed by other rules than the trainer's routers: with replay the experts used are the recorded
    ones on every recorded token-layer (rows of -1, the last tokens and a span wiped here, route live) and the
    logprob mismatch is a fraction of what it is without replay (the falsifier), where the experts disagree too."""
    def wipe(e):
        if e.episode_id == "100-0":
            e.routed_experts[5:11] = -1
    groups = batch(rollouts["biased"], wipe)
    rows_TLK = replay.packed_routing([e for g in groups for e in g.episodes], MODEL, "cpu").long()
    recorded_T = (rows_TLK[:, MOE_LAYERS[0]] >= 0).all(-1)
    assert 0 < (~recorded_T).sum() < len(recorded_T)
    metrics = {}
    for on in (True, False):
        trainer = make_trainer(routing_replay=on)
        with recording(trainer) as (used, live):
            metrics[on] = trainer.step(batch(groups))
        differ = 0
        for layer in MOE_LAYERS:
            used_TK, live_TK = torch.cat(used[layer]), torch.cat(live[layer])
            assert torch.equal(used_TK[~recorded_T], live_TK[~recorded_T])
            differ += (used_TK[recorded_T].sort(-1).values != rows_TLK[recorded_T, layer].sort(-1).values).any(-1).sum()
        if on:
            assert differ == 0
            assert torch.equal(torch.cat(used[MOE_LAYERS[0]])[recorded_T], rows_TLK[recorded_T, MOE_LAYERS[0]])
        else:
            assert differ > 0.1 * recorded_T.sum() * len(MOE_LAYERS)
    replayed, live_ = metrics[True], metrics[False]
    assert live_["mismatch_k3"] > 1e-2 and live_["mismatch_ratio_beyond_2"] > 0.05
    assert replayed["mismatch_k3"] < 1e-2 * live_["mismatch_k3"]  # (the wiped span routes live: not 0)
    assert replayed["mismatch_ratio_beyond_2"] < live_["mismatch_ratio_beyond_2"]
    # the routers' own picks disagree with the recorded ones either way (replay hides it)
    for m in (replayed, live_):
        assert 0.1 < m["routing_disagreement"] <= m["routing_disagreement_tokens"] < 1


def test_shuffled_expert_ids_raise_the_kl_and_the_disagreement(rollouts):
    """Replayed, the trainer reproduces the engine's logprobs; the falsifier: the same episodes with their recorded
    experts permuted."""
    perm_E = torch.tensor([3, 5, 0, 4, 1, 2])

    def shuffle(e):
        rows = e.routed_experts.long()
        e.routed_experts = torch.where(rows >= 0, perm_E[rows.clamp(min=0)], -1).to(torch.int16)
    true = make_trainer(routing_replay=True).step(batch(rollouts["biased"]))
    shuffled = make_trainer(routing_replay=True).step(batch(rollouts["biased"], shuffle))
    assert true["mismatch_k3"] < 1e-9 and abs(true["mismatch_kl"]) < 1e-6 and true["mismatch_ratio_beyond_2"] == 0
    assert shuffled["mismatch_k3"] > 1e-2
    assert shuffled["mismatch_ratio_beyond_2"] > 0.1
    assert shuffled["routing_disagreement"] > true["routing_disagreement"] + 0.3


def test_with_identical_numerics_replay_changes_nothing(rollouts):
    """The engine routed as the trainer does: the same loss and gradients with replay as without, no disagreement."""
    groups = rollouts["plain"]
    steps, grads = {}, {}
    for on in (True, False):
        grads[on] = gradients(make_trainer(routing_replay=on), batch(groups))
        steps[on] = make_trainer(routing_replay=on).step(batch(groups))
    for name, g in grads[True].items():
        torch.testing.assert_close(g, grads[False][name], rtol=1e-5, atol=1e-8, msg=name)
    assert steps[True]["loss"] == pytest.approx(steps[False]["loss"], rel=1e-5, abs=1e-8)
    for m in steps.values():
        assert m["routing_disagreement"] == 0 and m["routing_disagreement_tokens"] == 0
        assert m["mismatch_k3"] < 1e-9


def test_replay_keeps_the_routers_gradient_and_the_weights_formula():
    """The recorded experts are weighted by the full softmax gathered at them (renormalised), a function of the
    router logits; rows of -1 are `route`'s, bit for bit."""
    logits_TE = torch.randn(5, 6, generator=torch.Generator().manual_seed(0)).requires_grad_()
    recorded_TK = torch.tensor([[4, 0], [-1, -1], [5, 3], [2, 1], [-1, -1]])
    weights_TK, ids_TK = moe.route(logits_TE, 2, True, recorded_TK)
    live_w, live_ids = moe.route(logits_TE, 2, True)
    for t in (1, 4):
        assert torch.equal(ids_TK[t], live_ids[t]) and torch.equal(weights_TK[t], live_w[t])
    probs = torch.softmax(logits_TE.detach(), -1)
    for t in (0, 2, 3):
        assert torch.equal(ids_TK[t], recorded_TK[t])
        torch.testing.assert_close(weights_TK[t], probs[t, recorded_TK[t]] / probs[t, recorded_TK[t]].sum())
    (weights_TK * torch.arange(10.0).view(5, 2)).sum().backward()
    assert (logits_TE.grad[[0, 2, 3]].abs().sum(-1) > 0).all()


def test_under_replay_the_routers_get_a_gradient(rollouts):
    grads = gradients(make_trainer(routing_replay=True), batch(rollouts["biased"]))
    for layer in MOE_LAYERS:
        g = grads[f"model.layers.{layer}.mlp.gate.weight"]
        assert torch.isfinite(g).all() and g.abs().max() > 1e-6, layer


def test_replay_is_independent_of_packing_and_checkpointing(rollouts):
    """Micro-batches of 48 tokens (episodes packed several to one, the routing with them) and layers recomputed in the
    backward (which must replay too) give the gradients of one micro-batch."""
    expected = gradients(make_trainer(routing_replay=True), batch(rollouts["biased"]))
    for cfg in (dict(micro_batch_tokens=MICRO), dict(micro_batch_tokens=MICRO, activation_checkpointing=True)):
        got = gradients(make_trainer(routing_replay=True, **cfg), batch(rollouts["biased"]))
        for name, g in got.items():
            torch.testing.assert_close(g, expected[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name, c=cfg: f"{c} {n}: {m}")


def full_gradients(trainer: Trainer, groups: list[Group]) -> dict[str, torch.Tensor]:
    """`gradients`, each whole (all-gathered under FSDP: collective)."""
    trainer.optimizer.zero_grad(set_to_none=True)
    episodes = [e for g in groups for e in g.episodes]
    trainer._accumulate_gradients(episodes, [e.reward for e in episodes], sum(e.num_policy_tokens for e in episodes))
    grads = {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
             for name, p in trainer.master.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def _fsdp_rank(rank, results, port, path, out_dir):
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        torch.set_num_threads(1)
        trainer = make_trainer(fsdp=True, activation_checkpointing=True, routing_replay=True, micro_batch_tokens=MICRO)
        groups = torch.load(path, weights_only=False)
        out = {"gradients": full_gradients(trainer, groups), "metrics": trainer.step(groups)}
        torch.save(out, out_dir / f"rank{rank}.pt")
        dist.destroy_process_group()
        results.put((rank, "saved"))
    except BaseException as e:
        results.put((rank, f"{type(e).__name__}: {e}"))


@pytest.mark.slow
def test_fsdp_replay_step_equals_single_process_step(rollouts, tmp_path):
    """2 gloo ranks, each with its share of the episodes and their routing, checkpointed layers: the gradients and
    the metrics of one process. (Gradients rather than weights: AdamW's first step turns a gradient near its eps
    into a change of up to lr, so rounding alone moves a few weights by more than any useful tolerance.)"""
    torch.save(batch(rollouts["biased"]), tmp_path / "groups.pt")
    assert run_pair(_fsdp_rank, free_port(), tmp_path / "groups.pt", tmp_path) == {0: "saved", 1: "saved"}
    single = make_trainer(routing_replay=True, micro_batch_tokens=MICRO)
    grads = full_gradients(single, batch(rollouts["biased"]))
    expected = single.step(batch(rollouts["biased"]))
    assert expected["routing_disagreement"] > 0 and expected["mismatch_k3"] < 1e-9
    for out in (torch.load(tmp_path / f"rank{r}.pt") for r in range(2)):
        for key in expected.keys() - {"ess"}:  # (ess is averaged over micro-batches: it depends on the packing)
            assert out["metrics"][key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
        for name, g in grads.items():
            torch.testing.assert_close(out["gradients"][name], g, rtol=1e-4, atol=1e-6, msg=name)


# ---- configuration and the run ---------------------------------------------------------------------------------------


def test_replay_asks_the_engine_for_its_routing_and_is_refused_where_it_cannot_work():
    cfg = RunConfig(model="tiny-moe", trainer=TrainerConfig(routing_replay=True))
    assert cfg.engine.enable_return_routed_experts
    assert not RunConfig(model="tiny-moe").engine.enable_return_routed_experts
    on = TrainerConfig(routing_replay=True)
    with pytest.raises(ValueError, match="trainer.routing_replay: needs a mixture-of-experts model"):
        RunConfig(model="tiny", trainer=on)
    with pytest.raises(ValueError, match="trainer.routing_replay: not yet with placement disaggregated"):
        RunConfig(model="tiny-moe", trainer=on, placement="disaggregated")
    assert RunConfig(model="tiny-moe", trainer=on, engine=EngineConfig(host_cache="write_back")).engine.host_cache
    with pytest.raises(ValueError, match="trainer.routing_replay: needs a mixture-of-experts model"):
        Trainer(build_model("tiny", dtype="float32"), on, LossConfig())
    e = Episode("e", 0, tokens=[1, 2, 3], routed_experts=torch.zeros(2, 3, 2, dtype=torch.int16))
    with pytest.raises(ValueError, match="episode e: routed_experts has shape"):
        replay.packed_routing([e], MODEL, "cpu")
    e.routed_experts = torch.full((3, 3, 2), MODEL.num_experts, dtype=torch.int16)
    with pytest.raises(ValueError, match="names expert 6"):
        replay.packed_routing([e], MODEL, "cpu")


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_tandem_run_with_routing_replay_records_the_metrics(tmp_path, placement):
    """In the engine's thread, and in a process of its own (the routing over HTTP, decoded by the client)."""
    from tandem.run.main import main

    records = main(None, [
        f"placement={placement}",
        "model=tiny-moe", "steps=2", f"out_dir={tmp_path}", "trainer.routing_replay=true", "rollout.group_size=2",
        "rollout.batch_groups=2", "rollout.num_in_flight=4", "random_agent.prompt_len_max=24",
        "random_agent.response_len_median=6", "random_agent.response_len_max=16", "random_agent.max_context=96"])
    assert [r["step"] for r in records] == [1, 2]
    assert json.loads((tmp_path / "config.json").read_text())["engine"]["enable_return_routed_experts"]
    for record in (json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()):
        for key in METRICS:
            assert math.isfinite(record[key]) and record[key] >= 0, (key, record[key])
        assert record["routing_disagreement"] <= record["routing_disagreement_tokens"] <= 1
        # on-policy at the first step: the same weights on both sides, replayed, so (but for rounding) no mismatch
        if record["staleness_max"] == 0:
            assert record["mismatch_k3"] < 1e-6
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)  # buffered episodes keep their routing
    for g in state["manager"]["buffer"].values():
        assert all(isinstance(e["routed_experts"], torch.Tensor) for e in g["episodes"])
