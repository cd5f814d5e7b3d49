"""Prefix reuse on the random agent with a device KV pool too small for its working set, with and without the
host tier, against the ideal. Same episodes for every configuration of a point.

    python benchmarks/host_tier.py [--model tiny] [--device cpu] [--concurrency 32] [--episodes 96] [--out r.json]
        [--copies staged,staged_kernels,direct] [--parts]
    python benchmarks/host_tier.py --sweep [--quick] [--budget-s 240] [--out sweep.json]

The random agent's multi-turn episodes (every turn resubmits the whole history) run `--concurrency` at a time
through one engine. The working set is the KV of every in-flight episode at its longest (concurrency x mean
final episode length, from a first run with a pool that holds everything); the device pool is then sized at
`--pool-fraction` of it. Per configuration: prompt tokens, what an ideal cache would have served (the longest
prefix the engine had ever computed, per request), what was served from the device and the host tier, prefill
tokens actually computed, and their ratio to the ideal ("only new tokens": prompt minus ideal reuse), wall time,
engine steps, and the host time the tier's copies took (issuing, their scatters into the pool, and reaps that had
to wait: `waits` copies); under the table, per policy, how many copies and bus transfers (one per run of
consecutive host pages; a direct copy's launches count as its transfers) they took and their host time per page
moved and per copy (`--parts`: also the engine thread's host time by part of the prefix cache and the tier, wall
and CPU, from `engine_parts`). Each tier runs with each way of copying (`--copies`; the rows name it): staged,
and on CUDA staged_kernels and direct (`engine.host_cache_copy`).

`--sweep` runs the same table over model sizes and context lengths (`--context-scale` s multiplies the agent's
prompt and tool-output lengths and its context limit by s; responses stay as long), where prefill is dearer and
the tier should matter most: see SWEEP (`--quick`: tiny models on CPU), cheapest first; it starts no point once
`--budget-s` seconds have passed (each point is one engine per configuration, plus a warm-up for a model's first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import platform
import sys
import time

import torch
from engine_parts import timed_parts

from tandem.config import EngineConfig, RandomAgentConfig
from tandem.engine.engine import Engine
from tandem.rollout.agent import run_episode
from tandem.rollout.random_agent import RandomAgentEnv
from tandem.run.heap import frozen_heap
from tandem.types import Episode

AGENT = RandomAgentConfig(prompt_len_min=64, prompt_len_max=256, turns_min=3, turns_max=8, response_len_median=24,
                          response_len_max=256, obs_ratio=2.0, obs_len_max=256, max_context=2048)
# (model, context scale, concurrency, episodes) per point, write_through only (qwen3-0.6b at x1 is the default run);
# contexts up to 4,096 (x2) and 8,192 tokens (x4)
SWEEP = [("qwen3-0.6b", 2, 32, 64), ("qwen3-1.7b", 2, 32, 64), ("qwen3-4b", 2, 32, 64), ("qwen3-4b", 4, 16, 32)]
QUICK_SWEEP = [("tiny", 1, 8, 16), ("tiny", 4, 8, 16), ("small", 1, 8, 16)]


def scaled(scale: int) -> RandomAgentConfig:
    """The agent with prompts, tool outputs and its context limit `scale` times as long."""
    return dataclasses.replace(AGENT, prompt_len_min=AGENT.prompt_len_min * scale,
                               prompt_len_max=AGENT.prompt_len_max * scale, obs_ratio=AGENT.obs_ratio * scale,
                               obs_len_max=AGENT.obs_len_max * scale, max_context=AGENT.max_context * scale)


async def play(engine: Engine, agent: RandomAgentConfig, episodes: int, concurrency: int, vocab: int) -> list[Episode]:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> Episode:
        async with gate:
            env = RandomAgentEnv(agent, vocab, group_seed=i, sample=0)
            return await run_episode(engine, env, Episode(f"e{i}", i), agent.max_context)

    return await asyncio.gather(*[one(i) for i in range(episodes)])


def measure(model: str, dtype: str, config: EngineConfig, agent: RandomAgentConfig, episodes: int,
            concurrency: int, parts: bool = False) -> dict:
    with (Engine(model, config, dtype=dtype) as engine, frozen_heap(),  # (no full pass of the heap while timed)
          timed_parts() if parts else contextlib.nullcontext() as timed):
        t0, c0 = time.perf_counter(), time.thread_time()
        eps = asyncio.run(play(engine, agent, episodes, concurrency, engine.model_config.vocab_size))
        wall, clients = time.perf_counter() - t0, time.thread_time() - c0
        s = asyncio.run(engine.get_stats())
        tier = engine.tier
        copy = tier.copy if tier is not None else "off"
    new = s.prompt_tokens - s.prompt_tokens_ideal  # what even an ideal cache computes
    return {"episodes": eps, "copy": copy, "wall_s": wall, "clients_cpu_s": clients, "ideal": s.prompt_tokens_ideal,
            "cached": s.prompt_tokens_cached,
            "host": s.prefill_tokens_host, "computed": s.prefill_tokens_computed, "new": new,
            "retractions": s.num_retractions, "loaded": s.host_pages_loaded, "backed_up": s.host_pages_backed_up,
            "generated": s.generated_tokens, "busy_s": s.busy_seconds, "steps": s.num_steps,
            "schedule_s": s.schedule_seconds, "prepare_s": s.prepare_seconds, "forward_s": s.forward_seconds,
            "mean_batch": s.running_request_steps / max(1, s.num_steps),
            "tier_s": tier.clock.as_dict() if tier else {}, "flush_s": tier.flush_clock.as_dict() if tier else {},
            "issue_s": sum(tier.clock.wall[k] for k in ("backup", "load", "prefetch")) if tier else 0.0,
            "join_s": tier.clock.wall["scatter"] if tier else 0.0, "wait_s": tier.clock.wall["wait"] if tier else 0.0,
            "copies": [tier.num_backups, tier.num_loads, tier.num_prefetches] if tier else [0, 0, 0],
            "transfers": tier.num_transfers if tier else 0,
            "waits": tier.waits if tier else 0, "from_backups": tier.pages_from_backups if tier else 0,
            "prefetched": tier.pages_prefetched if tier else 0,
            "from_prefetch": tier.pages_from_prefetch if tier else 0, "parts": timed.as_dict() if timed else {},
            "parts_table": timed.table() if timed else ""}


def point(args, model: str, scale: int, concurrency: int, episodes: int, policies: list[str],
          copies: list[str]) -> dict:
    """One table: the pool that holds everything, the small pool without the tier, with it under each policy."""
    agent = scaled(scale)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    base = dict(page_size=args.page_size, device=args.device, max_running_requests=concurrency,
                max_prefill_tokens=args.max_prefill_tokens, measure_ideal_reuse=True)
    pages_for_all = concurrency * agent.max_context // args.page_size

    def run(**config) -> dict:
        return measure(model, dtype, EngineConfig(**base, **config), agent, episodes, concurrency, args.parts)

    if model not in args.warmed:  # warm-up: kernels, allocator (once a model)
        measure(model, dtype, EngineConfig(**base, num_pages=pages_for_all), agent, 4, 4)
        args.warmed.add(model)
    ideal = run(num_pages=pages_for_all)
    mean_len = sum(len(e.tokens) for e in ideal["episodes"]) / len(ideal["episodes"])
    working_set = int(concurrency * mean_len)
    pages = max(agent.max_context // args.page_size + 1, int(args.pool_fraction * working_set) // args.page_size)
    host_pages = 2 * working_set // args.page_size
    runs = {"pool holds everything": ideal}
    fraction = f"{args.pool_fraction:.2g} pool"
    runs[f"{fraction}, no host tier"] = off = run(num_pages=pages)
    if args.same_batch:  # the yardstick that leaves the pool's effect out: as few requests at once as the small pool
        cap = max(1, round(off["mean_batch"]))
        runs[f"pool holds everything, at most {cap} running"] = measure(
            model, dtype, EngineConfig(**{**base, "max_running_requests": cap}, num_pages=pages_for_all), agent,
            episodes, concurrency)
    tiers = {f"{policy}, {copy} copies": (policy, copy) for copy in copies for policy in policies}
    for tier, (policy, copy) in tiers.items():
        runs[f"{fraction} + host tier ({tier})"] = r = run(num_pages=pages, host_cache=policy,
                                                           host_cache_pages=host_pages, host_cache_copy=copy)
        assert r["copy"] == copy, f"asked for {copy} copies, the engine's tier made {r['copy']}"
    print(f"\n## {model} {dtype}, context x{scale}: {episodes} random-agent episodes, {concurrency} at a time, mean "
          f"length {mean_len:.0f} tokens: working set {working_set} tokens; device pool {pages * args.page_size} "
          f"tokens ({pages * args.page_size / working_set:.0%}), host tier {host_pages * args.page_size} tokens\n")
    print("| configuration | prompt tokens ideally reusable | served: device / host | prefill computed "
          "| only-new tokens | computed / only-new | retractions | pages loaded / backed up | wall s | engine steps "
          "| engine busy s | mean batch | copies: issue / scatter / wait s (waits) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['ideal']} | {r['cached'] - r['host']} / {r['host']} | {r['computed']} | {r['new']} | "
              f"{r['computed'] / r['new']:.3f} | {r['retractions']} | {r['loaded']} / {r['backed_up']} | "
              f"{r['wall_s']:.1f} | {r['steps']} | {r['busy_s']:.1f} | {r['mean_batch']:.1f} | "
              f"{r['issue_s']:.2f} / {r['join_s']:.2f} / {r['wait_s']:.2f} "
              f"({r['waits']}) |")
    parts = ", ".join(f"{name} {r['schedule_s']:.2f} / {r['prepare_s']:.2f} / {r['forward_s']:.2f}"
                      for name, r in runs.items())
    print("\nthe engine thread's busy s by part, schedule (with reaps, evictions, the tier's loads and prefetches) / "
          f"prepare (step inputs) / launch and drain (waiting for the device included): {parts}")
    if args.parts:
        print("\nthe engine thread's host time by part of the prefix cache and the tier (outermost calls; "
              "wall s / CPU s (calls, wall us a call)):\n" + "\n".join(f"- {name}: {r['parts_table']}"
                                                                     for name, r in runs.items()))
    print("\nthe clients' thread (the agents, on the engine's GIL), CPU s: "
          + ", ".join(f"{name} {r['clients_cpu_s']:.2f}" for name, r in runs.items()))
    for policy in tiers:  # (the policy and how its copies moved)
        r = runs[f"{fraction} + host tier ({policy})"]
        print(f"\n{policy}: wall {r['wall_s'] / off['wall_s']:.2f}x the run without the tier, "
              f"{r['wall_s'] / ideal['wall_s']:.2f}x the run whose pool holds everything (target: below 1.00x and at "
              f"most 1.30x); pages loaded {r['loaded']}: {r['from_prefetch']} from prefetches ({r['prefetched']} "
              f"prefetched), {r['from_backups']} from backups in flight")
        for name, same in runs.items():
            if name.startswith("pool holds everything, at most"):
                print(f"{policy}: wall {r['wall_s'] / same['wall_s']:.2f}x the run whose pool holds everything at the "
                      f"small pool's batch ({name}: the pool's smaller batch left out)")
        moved = r["loaded"] + r["backed_up"] + r["prefetched"]
        print(f"{policy}: {r['copies'][0]} backups, {r['copies'][1]} loads, {r['copies'][2]} prefetches; "
              f"{r['transfers']} bus transfers for {moved} pages moved (loaded, backed up, prefetched); host time "
              f"{(r['issue_s'] + r['join_s']) / max(1, moved) * 1e6:.1f} us a page, "
              f"{(r['issue_s'] + r['join_s']) / max(1, sum(r['copies'])) * 1e6:.0f} us a copy (issue + scatter)")
        print(f"{policy} host s, wall / engine thread's CPU (the rest: waiting, for a call or another thread's GIL): "
              + ", ".join(f"{k} {v['wall_s']:.2f} / {v['cpu_s']:.2f}" for k, v in r["tier_s"].items()))
        n = max(1, r["copies"][0])
        print(f"{policy} a backup flush, us wall / CPU: " + ", ".join(
            f"{k} {v['wall_s'] / n * 1e6:.0f} / {v['cpu_s'] / n * 1e6:.0f}" for k, v in r["flush_s"].items()))
    sys.stdout.flush()
    return {"model": model, "dtype": dtype, "context_scale": scale, "concurrency": concurrency, "episodes": episodes,
            "mean_len": mean_len, "working_set": working_set, "pool_tokens": pages * args.page_size,
            "host_tokens": host_pages * args.page_size,
            "runs": {name: {k: v for k, v in r.items() if k != "episodes"} for name, r in runs.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--episodes", type=int, default=96)
    ap.add_argument("--context-scale", type=int, default=1)
    ap.add_argument("--pool-fraction", type=float, default=0.25)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-prefill-tokens", type=int, default=2048)
    ap.add_argument("--policies", default="write_through,write_back")
    ap.add_argument("--copies", default=None,
                    help="how the tier's copies move pages (engine.host_cache_copy), e.g. staged,direct; default: "
                         "all three on CUDA, staged on CPU (a CPU pool's tier always copies with torch)")
    ap.add_argument("--sweep", action="store_true", help="over model sizes and context lengths (SWEEP)")
    ap.add_argument("--quick", action="store_true", help="with --sweep: tiny models (QUICK_SWEEP), for CPU")
    ap.add_argument("--points", default=None, help="with --sweep: the indices of the points to run, e.g. 0,2")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="with --sweep: start no point after this many seconds (those left are listed)")
    ap.add_argument("--out", default=None, help="JSON results, rewritten after every point")
    ap.add_argument("--same-batch", action="store_true",
                    help="also run the pool that holds everything with at most as many requests running as the small "
                         "pool ran on average (what is left of the gap is the copies', not the pool size's)")
    ap.add_argument("--parts", action="store_true",
                    help="also time the engine thread's parts of the prefix cache and the tier "
                         "(benchmarks/engine_parts.py; a few us of timer a call)")
    args = ap.parse_args()
    args.warmed = set()
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "CPU"
    print(f"# host tier benchmark, {datetime.date.today()}, {gpu}\n\n`python {' '.join(sys.argv)}`")
    if args.sweep:
        grid = QUICK_SWEEP if args.quick else SWEEP
        if args.points:
            grid = [grid[int(i)] for i in args.points.split(",")]
        todo = [(*p, ["write_through"]) for p in grid]
    else:
        todo = [(args.model, args.context_scale, args.concurrency, args.episodes, args.policies.split(","))]
    copies = args.copies.split(",") if args.copies else ["staged", "staged_kernels", "direct"] \
        if args.device.startswith("cuda") else ["staged"]
    results, skipped, began = [], [], time.perf_counter()
    print(f"\nthe tier's copies: {', '.join(copies)} (staged: device gather or scatter and a bus transfer per run of "
          "host pages; staged_kernels: the same halves, one kernel each; direct: one kernel a copy, straight between "
          "pool and pinned host pages)")
    for model, scale, concurrency, episodes, policies in todo:
        if args.sweep and time.perf_counter() - began > args.budget_s:
            skipped.append([model, scale, concurrency, episodes])
            continue
        t0 = time.perf_counter()
        results.append(point(args, model, scale, concurrency, episodes, policies, copies))
        results[-1]["point_s"] = time.perf_counter() - t0
        print(f"\n(point {model} x{scale}: {results[-1]['point_s']:.0f} s)")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": gpu, "argv": sys.argv, "points": results, "skipped": skipped}, f, indent=1)
    if skipped:
        print(f"\nnot run (past --budget-s {args.budget_s:.0f}): {skipped}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": gpu, "argv": sys.argv, "points": results, "skipped": skipped}, f, indent=1)


if __name__ == "__main__":
    main()
