"""Training a mixture-of-experts model: gradients reach the routers and both expert tensors; the routers'
load-balancing loss equals Hugging Face's `load_balancing_loss_func` (and a hand computation), is reported at every
step and, with a coefficient, trains the routers (and only what feeds them); the step stays independent of the
micro-batch packing, activation checkpointing and FSDP2 over 2 gloo ranks; compiled layers leave MoE regions eager;
`tandem run model=tiny-moe` trains end to end."""

import datetime
import json
import math

import pytest
import torch
import torch.distributed as dist
from test_main_table import render
from test_trainer_parallel import assert_weights_close, make_groups, weights
from test_transport import free_port, run_pair

from tandem.config import PRESETS, LossConfig, TrainerConfig
from tandem.model.attention import PackedCausal
from tandem.model.loader import build_model
from tandem.model.qwen3 import attention_inputs, attention_output_and_mlp
from tandem.trainer.balance import load_balancing_loss
from tandem.trainer.trainer import Trainer, compile_layers

CONFIG = PRESETS["tiny-moe"]
MOE_LAYERS = [i for i in range(CONFIG.num_hidden_layers) if CONFIG.is_sparse(i)]
MICRO = 48


def make_trainer(seed=0, **cfg) -> Trainer:
    cfg = dict(micro_batch_tokens=MICRO) | cfg
    return Trainer(build_model("tiny-moe", dtype="float32", seed=seed), TrainerConfig(**cfg), LossConfig())


def gradients(trainer: Trainer, groups) -> dict[str, torch.Tensor]:
    """The batch's gradients, micro-batch by micro-batch as `step` accumulates them (no optimizer step)."""
    trainer.optimizer.zero_grad(set_to_none=True)
    episodes = [e for g in groups for e in g.episodes]
    trainer._accumulate_gradients(episodes, [e.reward for e in episodes], sum(e.num_policy_tokens for e in episodes))
    return {name: p.grad.clone() for name, p in trainer.master.named_parameters()}


def expert_names(layer: int) -> list[str]:
    prefix = f"model.layers.{layer}.mlp"
    return [f"{prefix}.gate.weight", f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"]


def load_balancing_loss_func(*args):
    """Hugging Face's (imported here: the FSDP test's ranks import this module, and need no transformers)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    return load_balancing_loss_func(*args)


# ---- the loss against Hugging Face's and by hand -------------------------------------------------------------------


def test_the_load_balancing_loss_is_hugging_faces_per_sequence():
    gen = torch.Generator().manual_seed(0)
    lens, E, k = [7, 1, 12], 6, 2
    layers = [torch.randn(sum(lens), E, generator=gen) * 2 for _ in range(3)]
    got = load_balancing_loss(layers, k, lens)
    start = 0
    for i, n in enumerate(lens):
        expected = load_balancing_loss_func(tuple(logits[start:start + n] for logits in layers), E, k)
        assert got[i].item() == pytest.approx(expected.item(), rel=1e-6), i
        start += n
    # one sequence: Hugging Face's batch, every layer's rows together
    whole = load_balancing_loss(layers, k, [sum(lens)])
    assert whole.item() == pytest.approx(load_balancing_loss_func(tuple(layers), E, k).item(), rel=1e-6)


def test_the_load_balancing_loss_by_hand():
    """Two experts, top 1, one layer. Both tokens pick expert 0 (probabilities 3/4 and 1/4 each): f = (1, 0),
    P = (3/4, 1/4), loss = 2 * 3/4 = 3/2; d loss / d p_0 = 2 * f_0 / 2 tokens = 1 per token, and through the softmax
    d p_0 / d z = p_0 (1 - p_0) (1, -1) = 3/16 (1, -1). Balanced picks give k = 1."""
    logits = torch.tensor([[0.75, 0.25], [0.75, 0.25]]).log().requires_grad_()
    loss = load_balancing_loss([logits], 1, [2])
    assert loss.item() == pytest.approx(1.5)
    loss.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[3 / 16, -3 / 16]] * 2))
    balanced = torch.tensor([[0.75, 0.25], [0.25, 0.75]]).log()
    assert load_balancing_loss([balanced], 1, [2]).item() == pytest.approx(1.0)
    # every token and layer on the same 2 of 6 experts, all probability on them: E = 6
    collapsed = torch.full((5, 6), -1e4)
    collapsed[:, :2] = 0
    assert load_balancing_loss([collapsed, collapsed], 2, [5]).item() == pytest.approx(6.0)


# ---- the trainer ---------------------------------------------------------------------------------------------------


def test_gradients_reach_the_routers_and_both_expert_tensors_and_the_step_reports_the_balance():
    groups = make_groups(seed=1)
    trainer = make_trainer()
    before = weights(trainer)
    grads = gradients(trainer, groups)
    for layer in MOE_LAYERS:
        for name in expert_names(layer):
            assert torch.isfinite(grads[name]).all() and grads[name].abs().max() > 0, name
    # the metric: each episode's loss (Hugging Face's function over its router logits), weighted by its tokens
    episodes = [e for g in groups for e in g.episodes]
    model = build_model("tiny-moe", dtype="float32", seed=0)
    for block in model.moe_blocks:
        block.keep_router_logits = True
    expected = 0.0
    with torch.no_grad():
        for e in episodes:
            model(torch.tensor(e.tokens), torch.arange(len(e.tokens)), PackedCausal([len(e.tokens)]))
            logits = tuple(block.router_logits for block in model.moe_blocks)
            expected += len(e.tokens) * load_balancing_loss_func(logits, CONFIG.num_experts,
                                                                 CONFIG.num_experts_per_tok).item()
    expected /= sum(len(e.tokens) for e in episodes)
    metrics = trainer.step(groups)
    assert metrics["load_balancing_loss"] == pytest.approx(expected, rel=1e-5)
    assert CONFIG.num_experts_per_tok <= expected < CONFIG.num_experts
    after = weights(trainer)
    for layer in MOE_LAYERS:
        for name in expert_names(layer):
            assert not torch.equal(after[name], before[name]), name
    dense = Trainer(build_model("tiny", dtype="float32"), TrainerConfig(micro_batch_tokens=MICRO), LossConfig())
    assert "load_balancing_loss" not in dense.step(make_groups())


def test_the_coefficient_adds_its_gradient_to_the_routers_and_to_what_feeds_them_only():
    """The gradient is linear in the coefficient; it changes every router's, and not the head's nor the last MoE
    layer's experts' (no router reads their output)."""
    groups = make_groups(seed=2)
    grads = {coef: gradients(make_trainer(load_balancing_coef=coef), groups) for coef in (0.0, 0.1, 0.2)}
    for layer in MOE_LAYERS:
        name = f"model.layers.{layer}.mlp.gate.weight"
        one, two = grads[0.1][name] - grads[0.0][name], grads[0.2][name] - grads[0.0][name]
        assert one.abs().max() > 1e-3 * grads[0.0][name].abs().max(), name
        torch.testing.assert_close(two, 2 * one, rtol=1e-3, atol=1e-7)
    for name in ["lm_head.weight", *expert_names(MOE_LAYERS[-1])[1:]]:
        torch.testing.assert_close(grads[0.1][name], grads[0.0][name], rtol=1e-5, atol=1e-8, msg=name)


def test_with_the_balance_the_step_is_independent_of_packing_and_checkpointing():
    """Per episode, the load-balancing loss does not depend on which episodes share a micro-batch: one micro-batch,
    many, or recomputed layers (its logits are read outside the checkpointed layers) give the same gradients."""
    groups = make_groups(seed=3)
    expected = gradients(make_trainer(load_balancing_coef=0.1, micro_batch_tokens=4096), groups)
    for cfg in (dict(micro_batch_tokens=MICRO), dict(micro_batch_tokens=MICRO, activation_checkpointing=True)):
        got = gradients(make_trainer(load_balancing_coef=0.1, **cfg), groups)
        for name, g in got.items():
            torch.testing.assert_close(g, expected[name], rtol=1e-4, atol=1e-7,
                                       msg=lambda m, n=name, c=cfg: f"{c} {n}: {m}")


def test_bf16_compute_trains_a_moe_model_with_the_balance():
    trainer = make_trainer(param_dtype="bfloat16", lr=1e-2, load_balancing_coef=0.01)
    groups = make_groups(seed=4)
    steps = [trainer.step(groups) for _ in range(3)]  # (losses 0.03, -0.28, -0.48: the third clears the bar by 0.2)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3, [s["loss"] for s in steps]
    assert all(math.isfinite(s["load_balancing_loss"]) for s in steps)


def test_compiled_layers_leave_moe_regions_eager_and_give_the_eager_gradients():
    """The experts read which experts were hit on the host: their region would break its graph and recompile for
    each new set. Compiled: every layer's region before attention, the dense layer's region after; no graph takes a
    router's or an expert's weight."""
    graphs = []

    def backend(gm, example_inputs):  # records what dynamo captured, runs it as captured
        graphs.append({tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)})
        return gm.forward

    trainer = make_trainer(load_balancing_coef=0.1)
    groups = make_groups(seed=1)
    expected = gradients(trainer, groups)
    compile_layers(trainer.model, backend)
    for i, layer in enumerate(trainer.model.model.layers):
        assert layer.regions[0] is not attention_inputs
        assert (layer.regions[1] is attention_output_and_mlp) == (i in MOE_LAYERS)
    for name, g in gradients(trainer, groups).items():
        torch.testing.assert_close(g, expected[name], rtol=1e-5, atol=1e-7, msg=name)
    moe_shapes = {tuple(p.shape) for n, p in trainer.model.named_parameters() if ".mlp.gate." in n or "experts" in n}
    assert graphs and not any(shapes & moe_shapes for shapes in graphs)


# ---- FSDP2 -----------------------------------------------------------------------------------------------------------


def _fsdp_rank(rank, results, port, groups, out_dir):
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        torch.set_num_threads(1)
        trainer = make_trainer(fsdp=True, activation_checkpointing=True, load_balancing_coef=0.1)
        out = {"metrics": trainer.step(groups), "weights": weights(trainer)}
        torch.save(out, out_dir / f"rank{rank}.pt")  # not through the queue: it would share tensors by file descriptor
        dist.destroy_process_group()
        results.put((rank, "saved"))
    except BaseException as e:
        results.put((rank, f"{type(e).__name__}: {e}"))


@pytest.mark.slow
def test_fsdp_moe_step_equals_single_process_step(tmp_path):
    """2 gloo ranks, each with its share of the episodes (the experts sharded by FSDP over the ranks), checkpointed
    layers and the balance on: the same step as one process."""
    groups = make_groups()
    assert run_pair(_fsdp_rank, free_port(), groups, tmp_path) == {0: "saved", 1: "saved"}
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    single = make_trainer(load_balancing_coef=0.1)
    before = weights(single)
    expected = single.step(groups)
    assert expected["load_balancing_loss"] > 0
    for out in ranks:
        for key in expected.keys() - {"ess"}:  # ess is averaged over micro-batches, so it depends on the packing
            assert out["metrics"][key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
        # AdamW's first step is lr * g / (|g| + eps): for an expert a few tokens hit, gradients near eps turn their
        # rounding into differences of a few 1e-6 (lr is 1e-3)
        assert_weights_close(out["weights"], weights(single), rtol=1e-5, atol=1e-5)
    for layer in MOE_LAYERS:
        for name in expert_names(layer):
            assert not torch.equal(ranks[0]["weights"][name], before[name]), name


# ---- end to end ------------------------------------------------------------------------------------------------------


def test_tandem_run_trains_the_tiny_moe_fully_async_and_records_the_balance(tmp_path):
    from tandem.run.main import main

    records = main(None, [
        "model=tiny-moe", "steps=3", f"out_dir={tmp_path}", "trainer.load_balancing_coef=0.01", "rollout.group_size=2",
        "rollout.batch_groups=2", "rollout.num_in_flight=8", "random_agent.prompt_len_max=40",
        "random_agent.response_len_median=6", "random_agent.response_len_max=64", "random_agent.max_context=256"])
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["version"] == 3
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for record in lines:
        assert CONFIG.num_experts_per_tok * 0.9 < record["load_balancing_loss"] < CONFIG.num_experts, record
        assert record["tokens_trained"] > 0 and math.isfinite(record["loss"])
    assert all(r["staleness_max"] <= 2 for r in lines)  # async within the default bound
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["trainer"]
    assert state["version"] == 3
    initial = dict(build_model("tiny-moe", dtype="float32", seed=0).named_parameters())
    for layer in MOE_LAYERS:
        for name in expert_names(layer):
            assert not torch.equal(state["model"][name], initial[name]), name
    lines, headers = render(400, records)  # the live table, on a console wide enough for every column
    row = [cell.strip() for cell in lines[-2].strip("│").split("│")]
    assert row[headers.index("lb loss")] == f"{records[-1]['load_balancing_loss']:.3f}"
