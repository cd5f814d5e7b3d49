"""The race guard's three arms (issue 25): elements of the fixed-buffer replays' inputs that changed while a replay
ran, on the engine's placement, on a broken one, and on the engine's placement under load; and what the guard
costs (the same workload with the guard off).

    python benchmarks/race_guard.py [--model qwen3-0.6b] [--device cuda] [--requests 64] [--load 256]
                                    [--max-new 128] [--quick] [--out FILE]

The broken arm runs `step_order.mutants()["prep_without_war"]`: the graph's inputs copied on a stream of their
own that waits for nothing, so the next step's copies may land while the previous replay still reads them (the
test-only switch `TANDEM_TEST_PLACEMENT`). On a CPU there are no streams, so every arm reads 0: run it on a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import random
import sys
import time

import torch
from engine_throughput import parse_with_quick

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.streams import MUTANT_ENV
from tandem.types import SamplingParams


def run_arm(model: str, device: str, requests: int, max_new: int, guard: bool, mutant: str | None,
            seed: int = 0) -> dict:
    """`requests` concurrent requests (prompts of 32 to 512 tokens, sampled, seeded) through a fresh engine."""
    if mutant:
        os.environ[MUTANT_ENV] = mutant
    try:
        config = EngineConfig(device=device, num_pages=0 if device == "cuda" else 2048,
                              max_running_requests=max(requests, 8), race_guard=guard)
        engine = Engine(model, config, dtype="bfloat16" if device == "cuda" else "float32", seed=seed)
    finally:
        os.environ.pop(MUTANT_ENV, None)
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(32, 513))] for _ in range(requests)]
    sampling = [SamplingParams(max_new_tokens=max_new, ignore_eos=True, seed=i) for i in range(requests)]

    async def everything():
        return await asyncio.gather(*[engine.generate(p, s) for p, s in zip(prompts, sampling, strict=True)])

    with engine:
        asyncio.run(everything())  # warm-up: compiles, allocator
        t0 = time.perf_counter()
        outs = asyncio.run(everything())
        seconds = time.perf_counter() - t0
        result = {"requests": requests, "tokens_per_s": sum(len(o.output_ids) for o in outs) / seconds}
        if guard:
            result |= {"changed": engine.runner.guard.count(), "replays": engine.runner.guard.replays}
    engine = outs = None  # (the closure holds the name: drop what it refers to)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()  # the next arm's engine sizes its KV pool from free memory
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--load", type=int, default=256, help="concurrent requests of the loaded arm")
    parser.add_argument("--max-new", type=int, default=128)
    args = parse_with_quick(parser, dict(model="tiny", requests=8, load=32, max_new=16))
    arms = [("engine placement", args.requests, True, None),
            ("broken: prep stream without the write-after-read edge", args.requests, True, "prep_without_war"),
            ("engine placement under load", args.load, True, None),
            ("engine placement under load, guard off", args.load, False, None)]
    results = {}
    print(f"race guard, {args.model} on {args.device}, {args.max_new} new tokens per request")
    print(f"{'arm':<58} {'requests':>8} {'replays':>8} {'changed':>8} {'tok/s':>9}")
    for name, requests, guard, mutant in arms:
        r = results[name] = run_arm(args.model, args.device, requests, args.max_new, guard, mutant)
        print(f"{name:<58} {requests:>8} {r.get('replays', '-'):>8} {r.get('changed', '-'):>8} "
              f"{r['tokens_per_s']:>9.0f}")
    on, off = (results[a[0]]["tokens_per_s"] for a in arms[2:])
    print(f"the guard's cost under load: {on / off:.3f}x the throughput without it")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "argv": sys.argv, "arms": results}, f, indent=1)


if __name__ == "__main__":
    main()
