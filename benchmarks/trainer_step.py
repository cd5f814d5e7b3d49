"""The trainer's step on batches shaped like the random agent's: time per step, tokens per second, the model
FLOP utilisation, and where the time goes (torch.profiler, top operators).

    python benchmarks/trainer_step.py [--model qwen3-0.6b] [--device cuda] [--steps 5] [--groups 4]
                                      [--group-size 4] [--param-dtype bfloat16] [--profile] [--host-profile]
                                      [trainer.compile=false ...]

Episodes are built by driving `RandomAgentEnv` with random responses of the lengths it asks for (the benchmark
defaults of `async_speedup.py`: median 16, sigma 1.2, at most 512 tokens per turn), so token counts match an RL
step's. FLOPs: 6 x parameters x tokens (forward and backward of the matmuls) plus the causal attention's
6 x layers x heads x head_dim x sum(len^2), against a peak given by `--peak-tflops` (H200 dense bf16: 989).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import random
import statistics
import time

import torch

from tandem.config import LossConfig, RandomAgentConfig, RunConfig
from tandem.model.loader import build_model
from tandem.rollout.random_agent import RandomAgentEnv
from tandem.trainer.trainer import Trainer
from tandem.types import Episode, Group

AGENT = RandomAgentConfig(response_len_median=16, response_len_sigma=1.2, response_len_max=512)


def random_agent_batch(vocab_size: int, num_groups: int, group_size: int, seed: int) -> list[Group]:
    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        episodes = []
        for j in range(group_size):
            env, episode = RandomAgentEnv(AGENT, vocab_size, seed + g, j), Episode(f"{g}-{j}", g)
            episode.add(asyncio.run(env.reset()), policy=False)
            for turn in range(AGENT.turns_max):
                n = min(env.sampling(turn).max_new_tokens, AGENT.max_context - len(episode.tokens))
                response = [rng.randrange(vocab_size) for _ in range(n)]
                episode.add(response, policy=True, logprobs=[-10.0] * n, versions=[0] * n)
                result = asyncio.run(env.step(response))
                if result.done or len(episode.tokens) >= AGENT.max_context:
                    episode.reward = result.reward if result.done else 0.0
                    break
                episode.add(result.observation[:AGENT.max_context - len(episode.tokens) - 1], policy=False)
            episodes.append(episode)
        groups.append(Group(g, episodes, 0))
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--param-dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--profile", action="store_true", help="profile one more step and print the top operators")
    parser.add_argument("--host-profile", action="store_true",
                        help="one more step under cProfile: the Python functions that take the host's time")
    parser.add_argument("overrides", nargs="*", help="trainer settings, e.g. trainer.compile=false")
    args = parser.parse_args()
    model = build_model(args.model, device=args.device, dtype="float32")
    config, params = model.config, sum(p.numel() for p in model.parameters())
    trainer_cfg = RunConfig.load(None, [f"trainer.param_dtype={args.param_dtype}", *args.overrides]).trainer
    trainer = Trainer(model, trainer_cfg, LossConfig())
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    batches = [random_agent_batch(config.vocab_size, args.groups, args.group_size, seed)
               for seed in range(args.steps + 2)]
    seconds = []
    for batch in batches[:args.steps + 1]:  # the first is warm-up
        sync()
        t0 = time.perf_counter()
        trainer.step(batch)
        sync()
        seconds.append(time.perf_counter() - t0)
    timed = batches[1:args.steps + 1]
    lens = [[len(e.tokens) for g in batch for e in g.episodes] for batch in timed]
    tokens = statistics.mean(sum(x) for x in lens)
    trained = statistics.mean(sum(e.num_policy_tokens for g in b for e in g.episodes) for b in timed)
    attn = 6 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    flops = statistics.mean(6 * params * sum(x) + attn * sum(n * n for n in x) for x in lens)
    step = statistics.median(seconds[1:])
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"## trainer step ({name}, model {args.model}, {params / 1e6:.0f}M parameters, {args.param_dtype} over "
          f"float32 masters, compile={trainer_cfg.compile}, fused_kernels={trainer_cfg.fused_kernels})")
    print(f"batch: {args.groups} x {args.group_size} episodes, {tokens:.0f} tokens ({trained:.0f} trained), longest "
          f"{max(max(x) for x in lens)}; first step (warm-up) {1e3 * seconds[0]:.0f} ms")
    print(f"step {1e3 * step:.0f} ms (median of {args.steps}): {tokens / step:.0f} tok/s, {trained / step:.0f} "
          f"trained tok/s, {flops / step / 1e12:.1f} TFLOP/s = {flops / step / 1e12 / args.peak_tflops:.1%} of "
          f"{args.peak_tflops:g}")
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            trainer.step(batches[-1])
            sync()
        key = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=50))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
    if args.host_profile:
        profiler = cProfile.Profile()
        sync()
        profiler.enable()
        trainer.step(batches[-1])
        sync()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
