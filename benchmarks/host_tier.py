"""Prefix reuse on the random agent with a device KV pool too small for its working set, with and without the
host tier, against the ideal. One run, same episodes for every configuration.

    python benchmarks/host_tier.py [--model tiny] [--device cpu] [--concurrency 32] [--episodes 96]

The random agent's multi-turn episodes (every turn resubmits the whole history) run `--concurrency` at a time
through one engine. The working set is the KV of every in-flight episode at its longest (concurrency x mean
final episode length, from a first run with a pool that holds everything); the device pool is then sized at
`--pool-fraction` of it. Per configuration: prompt tokens, what an ideal cache would have served (the longest
prefix the engine had ever computed, per request), what was served from the device and the host tier, prefill
tokens actually computed, and their ratio to the ideal ("only new tokens": prompt minus ideal reuse).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import sys
import time

import torch

from tandem.config import EngineConfig, RandomAgentConfig
from tandem.engine.engine import Engine
from tandem.rollout.agent import run_episode
from tandem.rollout.random_agent import RandomAgentEnv
from tandem.types import Episode

AGENT = RandomAgentConfig(prompt_len_min=64, prompt_len_max=256, turns_min=3, turns_max=8, response_len_median=24,
                          response_len_max=256, obs_ratio=2.0, obs_len_max=256, max_context=2048)


async def play(engine: Engine, episodes: int, concurrency: int, vocab: int) -> list[Episode]:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> Episode:
        async with gate:
            env = RandomAgentEnv(AGENT, vocab, group_seed=i, sample=0)
            return await run_episode(engine, env, Episode(f"e{i}", i), AGENT.max_context)

    return await asyncio.gather(*[one(i) for i in range(episodes)])


def measure(model: str, dtype: str, config: EngineConfig, episodes: int, concurrency: int) -> dict:
    with Engine(model, config, dtype=dtype) as engine:
        t0 = time.perf_counter()
        eps = asyncio.run(play(engine, episodes, concurrency, engine.model_config.vocab_size))
        wall = time.perf_counter() - t0
        s = asyncio.run(engine.get_stats())
        tier = engine.tier
    new = s.prompt_tokens - s.prompt_tokens_ideal  # what even an ideal cache computes
    return {"episodes": eps, "wall_s": wall, "ideal": s.prompt_tokens_ideal, "cached": s.prompt_tokens_cached,
            "host": s.prefill_tokens_host, "computed": s.prefill_tokens_computed, "new": new,
            "retractions": s.num_retractions, "loaded": s.host_pages_loaded, "backed_up": s.host_pages_backed_up,
            "generated": s.generated_tokens, "busy_s": s.busy_seconds, "steps": s.num_steps,
            "issue_s": tier.issue_seconds if tier else 0.0, "wait_s": tier.wait_seconds if tier else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--episodes", type=int, default=96)
    ap.add_argument("--pool-fraction", type=float, default=0.25)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    base = dict(page_size=args.page_size, device=args.device, max_running_requests=args.concurrency,
                max_prefill_tokens=2048, measure_ideal_reuse=True)
    pages_for_all = args.concurrency * AGENT.max_context // args.page_size
    def run(**config) -> dict:
        return measure(args.model, dtype, EngineConfig(**base, **config), args.episodes, args.concurrency)

    measure(args.model, dtype, EngineConfig(**base, num_pages=pages_for_all), 4, 4)  # warm-up: kernels, allocator
    ideal = run(num_pages=pages_for_all)
    mean_len = sum(len(e.tokens) for e in ideal["episodes"]) / len(ideal["episodes"])
    working_set = int(args.concurrency * mean_len)
    pages = max(AGENT.max_context // args.page_size + 1, int(args.pool_fraction * working_set) // args.page_size)
    host_pages = 2 * working_set // args.page_size
    runs = {"pool holds everything": ideal}
    fraction = f"{args.pool_fraction:.2g} pool"
    runs[f"{fraction}, no host tier"] = run(num_pages=pages)
    for policy in ("write_through", "write_back"):
        runs[f"{fraction} + host tier ({policy})"] = run(num_pages=pages, host_cache=policy,
                                                         host_cache_pages=host_pages)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "CPU"
    print(f"# host tier benchmark, {datetime.date.today()}, {gpu}, model {args.model} {dtype}\n")
    print(f"`python {' '.join(sys.argv)}`\n")
    print(f"{args.episodes} random-agent episodes, {args.concurrency} at a time, mean length {mean_len:.0f} tokens: "
          f"working set {working_set} tokens; device pool {pages * args.page_size} tokens "
          f"({pages * args.page_size / working_set:.0%}), host tier {host_pages * args.page_size} tokens\n")
    print("| configuration | prompt tokens ideally reusable | served: device / host | prefill computed "
          "| only-new tokens | computed / only-new | retractions | pages loaded / backed up | wall s | engine steps "
          "| engine busy s | copies: issue / wait s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['ideal']} | {r['cached'] - r['host']} / {r['host']} | {r['computed']} | {r['new']} | "
              f"{r['computed'] / r['new']:.3f} | {r['retractions']} | {r['loaded']} / {r['backed_up']} | "
              f"{r['wall_s']:.1f} | {r['steps']} | {r['busy_s']:.1f} | {r['issue_s']:.2f} / {r['wait_s']:.2f} |")


if __name__ == "__main__":
    main()
