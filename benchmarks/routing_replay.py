"""Rollout routing replay (R3): how far the trainer's MoE routing and logprobs are from the engine's, with and
without replay, and what it does to learning.

    python benchmarks/routing_replay.py [--device cuda] [--quick] [--steps 30] [--out FILE]

The engine runs its fast path (bf16 weights and KV; on CUDA also graphs and fused kernels), the trainer float32:
the two sides' numerics differ as in a real run, and near-ties between experts route some tokens apart.

(a) On the same rollouts: one batch of random-agent episodes (multi-turn, long-tailed) is collected once from the
engine through the rollout manager, on the bf16 cast of the trainer's float32 weights, routing recorded. Fresh
trainers on those float32 weights then step on identical copies of the batch, replay on and replay off; each step's
metrics (before its update) are the rollout/trainer mismatch: `routing_disagreement` (token-layers whose expert
sets differ between the trainer's routers and the rollout), `routing_disagreement_tokens` (tokens with any such
layer), the k3 KL of the behaviour against the trainer's logprobs, and the fraction of tokens whose ratio is beyond
2 (or below 1/2). Under replay the trainer uses the recorded experts, so its disagreement is 0 by construction; the
metric reported beside it is what its routers would have picked. The floor: the same shape without experts (every
layer a dense MLP), through the same engine and trainer, on episodes of the same seeds: bf16 against fp32 alone.
(b) Learning: two `tandem run`s of `task=target_tokens` (reward: the share of tokens in an eighth of the
vocabulary; a random policy gets about 0.125), replay on and off, same seed; the reward and the mismatch per step.

Targets (issue 21): with replay, 0 token-layers routed apart from the rollout; on the same rollouts, k3 KL with
replay at most half of that without.

Models: on a CPU (`--quick`) `tiny-moe` (3 layers, the first dense; 6 experts, 2 a token); on CUDA a scaled-down
Qwen3-30B-A3B, `qwen3-moe-mini` below (12 layers, hidden 1024, 32 experts of 512, 4 a token: 0.98B parameters,
0.45B active, 0.31B of them the 151,936-token embedding and head); its dense floor (a dense MLP of 2048 in every
layer) has 0.45B. Random weights.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from tandem.config import PRESETS, EngineConfig, LossConfig, ModelConfig, RunConfig, TrainerConfig
from tandem.engine.engine import Engine
from tandem.model.loader import build_model
from tandem.rollout.manager import RolloutManager
from tandem.rollout.registry import make_env_factory
from tandem.run.loop import run_recording
from tandem.trainer.trainer import Trainer
from tandem.types import Group

METRICS = ("routing_disagreement", "routing_disagreement_tokens", "mismatch_k3", "mismatch_ratio_beyond_2")
# Qwen3-30B-A3B scaled down to one GPU's quick experiment: a quarter of the layers, half the width, a quarter of the
# experts, half the top-k
QWEN3_MOE_MINI = PRESETS["qwen3-30b-a3b"].with_(num_hidden_layers=12, hidden_size=1024, intermediate_size=2048,
                                                num_attention_heads=16, num_key_value_heads=4, num_experts=32,
                                                num_experts_per_tok=4, moe_intermediate_size=512)


def model_dir(config: ModelConfig, root: Path, name: str) -> str:
    """A directory holding `config`'s config.json (no weights: random, seeded), which a run takes as `model=`."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return str(path)


def dense_of(config: ModelConfig) -> ModelConfig:
    """The floor: the same shape without experts, every layer a dense MLP of `intermediate_size` (set to about the
    active experts' width)."""
    return config.with_(num_experts=0, mlp_only_layers=())


def engine_config(device: str, routing: bool) -> EngineConfig:
    if device == "cpu":
        return EngineConfig(device=device, num_pages=1024, enable_return_routed_experts=routing)
    return EngineConfig(device=device, num_pages=0, kv_memory_fraction=0.3, enable_return_routed_experts=routing)


async def collect(engine: Engine, cfg: RunConfig, routing: bool) -> list[Group]:
    """One batch of `cfg.rollout.batch_groups` groups through the rollout manager, all at the engine's version."""
    max_context = min(cfg.random_agent.max_context, engine.max_context_len)
    manager = RolloutManager(engine, make_env_factory(cfg, engine.model_config.vocab_size), cfg.rollout, max_context,
                             cfg.seed, version=lambda: engine.weight_version, routing=routing)
    admit = asyncio.create_task(manager.run())
    try:
        return await manager.next_batch()
    finally:
        admit.cancel()
        await manager.stop()


def same_rollouts(model: str, cfg: RunConfig, device: str, replay_modes: tuple[bool, ...]) -> dict:
    """(a) for one model: a batch from the bf16 engine, then a fresh float32 trainer's step on a copy of it per
    replay mode. Returns {"replay"/"live": metrics, "episodes", "tokens"}."""
    policy = build_model(model, device=device, dtype="float32", seed=cfg.seed)
    routing = policy.config.is_moe
    with Engine(copy.deepcopy(policy).to(torch.bfloat16), engine_config(device, routing)) as engine:
        groups = asyncio.run(collect(engine, cfg, routing))
    episodes = [e for g in groups for e in g.episodes]
    out = {"episodes": len(episodes), "tokens": sum(len(e.tokens) for e in episodes),
           "policy_tokens": sum(e.num_policy_tokens for e in episodes)}
    for on in replay_modes:
        trainer = Trainer(copy.deepcopy(policy), TrainerConfig(routing_replay=on, compile=False), LossConfig(),
                          cfg.rollout.temperature)
        step = trainer.step(copy.deepcopy(groups))
        out["replay" if on else "live"] = {k: step.get(k, float("nan")) for k in ("mismatch_kl", *METRICS)}
        del trainer
    return out


def learning_run(model: str, replay: bool, args, device: str, root: Path) -> list[dict]:
    """(b): one `tandem run` of target_tokens; per step the reward and the mismatch."""
    overrides = [f"model={model}", "task=target_tokens", f"steps={args.steps}", f"seed={args.seed}",
                 f"out_dir={root / ('replay' if replay else 'live')}", "checkpoint_every=0", "engine_dtype=bfloat16",
                 f"engine.device={device}", f"trainer_device={device}", "trainer.lr=1e-2", "trainer.compile=false",
                 "engine.enable_return_routed_experts=true", f"trainer.routing_replay={str(replay).lower()}",
                 f"rollout.group_size={args.group_size}", f"rollout.batch_groups={args.batch_groups}",
                 f"rollout.num_in_flight={args.group_size * args.batch_groups}", "rollout.max_staleness=0"]
    if device != "cpu":
        overrides += ["engine.num_pages=0", "engine.kv_memory_fraction=0.3"]
    _, history, _ = run_recording(RunConfig.load(None, overrides))
    return [{"step": h["step"], "reward_mean": h["reward_mean"], **{k: h.get(k) for k in METRICS}} for h in history]


def fmt(x, digits: int = 4) -> str:
    if x is None or x != x:
        return "-"
    return f"{x:.{digits}g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes: tiny-moe, a few groups and steps (CPU)")
    parser.add_argument("--model", default=None, help="a MoE preset or config dir (default: tiny-moe with --quick "
                        "or on a CPU, else qwen3-moe-mini)")
    parser.add_argument("--groups", type=int, default=None, help="(a): groups in the batch (default 16 quick, 64)")
    parser.add_argument("--steps", type=int, default=None, help="(b): steps a run (default 30 quick, 40)")
    parser.add_argument("--group-size", type=int, default=None, help="(default 4 quick, 8)")
    parser.add_argument("--batch-groups", type=int, default=None, help="(b): groups a step (default 4 quick, 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-learning", action="store_true", help="(a) only")
    parser.add_argument("--out", default=None, help="write every figure to this JSON file")
    args = parser.parse_args()
    quick = args.quick or args.device == "cpu"
    args.groups = args.groups or (16 if quick else 64)
    args.steps = args.steps or (30 if quick else 40)
    args.group_size = args.group_size or (4 if quick else 8)
    args.batch_groups = args.batch_groups or (4 if quick else 16)
    device = "cuda:0" if args.device == "cuda" else args.device
    if args.device == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    root = Path(tempfile.mkdtemp(prefix="tandem-r3-"))
    name = args.model or ("tiny-moe" if quick else "qwen3-moe-mini")
    if name == "qwen3-moe-mini":
        moe_config = QWEN3_MOE_MINI
    elif name in PRESETS:
        moe_config = PRESETS[name]
    else:  # a config directory
        moe_config = ModelConfig.from_hf_dict(json.loads((Path(name) / "config.json").read_text()))
    if not moe_config.is_moe:
        parser.error(f"--model: {name} has no mixture-of-experts layers")
    moe, dense = model_dir(moe_config, root, "moe"), model_dir(dense_of(moe_config), root, "dense")
    machine = torch.cuda.get_device_name(0) if device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    print(f"## routing replay ({datetime.date.today()}, {machine}, Python {platform.python_version()}, "
          f"torch {torch.__version__})")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"model {name} ({moe_config.num_hidden_layers} layers, {moe_config.num_experts} experts, "
          f"{moe_config.num_experts_per_tok} a token); engine bfloat16 on {device}, trainer float32\n")
    result: dict = {"command": sys.argv, "device": machine, "model": name, "model_config": moe_config.to_hf_dict()}

    # (a) the same rollouts, replay on and off; the dense floor
    cfg = RunConfig.load(None, [f"seed={args.seed}", "task=random", f"rollout.group_size={args.group_size}",
                                f"rollout.batch_groups={args.groups}", "rollout.max_staleness=0",
                                f"rollout.num_in_flight={args.group_size * args.groups}"]
                         + (["random_agent.max_context=512"] if quick else []))
    same = {"moe": same_rollouts(moe, cfg, device, (True, False)), "dense": same_rollouts(dense, cfg, device, (False,))}
    result["same_rollouts"] = same
    m = same["moe"]
    print(f"(a) the same rollouts: {m['episodes']} random-agent episodes, {m['tokens']} tokens "
          f"({m['policy_tokens']} sampled), one batch from the bf16 engine; each row a fresh float32 trainer's step "
          "on a copy of it\n")
    print("| model | replay | token-layers routed apart | tokens routed apart | k3 KL | k1 KL | ratio beyond 2 |")
    print("|---|---|---|---|---|---|---|")
    rows = [("MoE", "on", m["replay"]), ("MoE", "off", m["live"]), ("dense floor", "-", same["dense"]["live"])]
    for label, mode, r in rows:
        # under replay the trainer uses the recorded experts: no token-layer is routed apart; its routers' own picks
        # (the metric) in brackets
        apart = ("0 (routers' own pick: " + fmt(r["routing_disagreement"]) + ")" if mode == "on"
                 else fmt(r["routing_disagreement"]) if mode == "off" else "-")
        tokens = fmt(r["routing_disagreement_tokens"]) if mode != "-" else "-"
        print(f"| {label} | {mode} | {apart} | {tokens} | {fmt(r['mismatch_k3'])} | {fmt(r['mismatch_kl'])} | "
              f"{fmt(r['mismatch_ratio_beyond_2'])} |")
    k3_on, k3_off, floor = (r["mismatch_k3"] for r in (m["replay"], m["live"], same["dense"]["live"]))
    # what routing adds over the floor (the bf16 rounding everywhere else), with replay against without
    excess = (k3_on - floor) / (k3_off - floor) if k3_off > floor else None
    result["targets"] = {"replayed_token_layers_apart": 0, "k3_replay_over_live": k3_on / k3_off if k3_off else None,
                         "k3_met": k3_on <= 0.5 * k3_off, "k3_excess_over_floor_replay_over_live": excess}
    print(f"\ntargets: token-layers routed apart under replay 0 (by construction: met); k3 with replay / without "
          f"{fmt(result['targets']['k3_replay_over_live'], 3)} (target at most 0.5: "
          f"{'met' if result['targets']['k3_met'] else 'not met'}); above the dense floor's k3, with replay / "
          f"without {fmt(excess, 3)}\n")

    # (b) learning, replay on and off
    if not args.skip_learning:
        curves = {mode: learning_run(moe, mode == "on", args, device, root) for mode in ("on", "off")}
        result["learning"] = curves
        print(f"(b) target_tokens, {args.steps} steps of {args.batch_groups} groups of {args.group_size}, lr 1e-2, "
              f"synchronous (max_staleness 0: the mismatch is the numerics', not staleness'), "
              f"seed {args.seed}; replay on and off\n")
        print("| step | reward (replay on) | reward (off) | k3 KL (on) | k3 KL (off) | tokens routed apart (on: "
              "routers' own pick) | (off) |")
        print("|---|---|---|---|---|---|---|")
        for on, off in zip(curves["on"], curves["off"], strict=True):
            print(f"| {on['step']} | {on['reward_mean']:.3f} | {off['reward_mean']:.3f} | {fmt(on['mismatch_k3'])} | "
                  f"{fmt(off['mismatch_k3'])} | {fmt(on['routing_disagreement_tokens'])} | "
                  f"{fmt(off['routing_disagreement_tokens'])} |")
        quarter = max(1, args.steps // 4)
        for mode, curve in curves.items():
            first = statistics.mean(h["reward_mean"] for h in curve[:quarter])
            last = statistics.mean(h["reward_mean"] for h in curve[-quarter:])
            result[f"reward_{mode}"] = {"first_quarter": first, "last_quarter": last}
            print(f"\nreplay {mode}: reward {first:.3f} over the first quarter of the steps, {last:.3f} over the last",
                  end="")
        print()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
