"""Triton compiles in the middle of a run: which kernels get a new compiled variant after the engine started.

    python benchmarks/jit_variants.py [--model qwen3-0.6b] [--max-prefill-tokens 512 8192] [--out variants.json]

Triton compiles a kernel once per signature: its compile-time constants, and, unless an argument is listed in
`do_not_specialize`, whether each integer argument is 1 or divisible by 16 (and each pointer's alignment). A
signature first seen mid-run compiles there (hundreds of milliseconds, every request of the engine waiting). For
each engine configuration: start an engine on the GPU (its CUDA graphs captured), run one short greedy request,
then requests of varied prompt lengths (1 to 6,000 tokens, log-uniform) and sampling parameters (greedy,
temperature, top-p, top-k, min-p, top logprobs) in waves; count the compiled variants of every Triton kernel of
`tandem.kernels` after each phase, print the new ones with their signatures, and the engine's slow steps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib
import json
import logging
import math
import random
import sys
import time

import torch
import triton

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.run.heap import frozen_heap
from tandem.types import SamplingParams

MODULES = ("decode_attention", "prefill_attention", "fused", "sampling", "small_linear", "kv_copy", "moe",
           "moe_routing")


def compiled() -> dict[str, set[str]]:
    """Kernel name -> the keys of its compiled variants (every device), for each Triton kernel of tandem.kernels."""
    out = {}
    for name in MODULES:
        module = importlib.import_module(f"tandem.kernels.{name}")
        for attr, fn in vars(module).items():
            if isinstance(fn, triton.runtime.jit.JITFunction):
                out[f"{name}.{attr}"] = {str(key) for cache in fn.device_caches.values() for key in cache[0]}
    return out


class SlowSteps(logging.Handler):
    """The engine's slow-step warnings, kept."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record):
        if "every request waited" in (message := record.getMessage()):
            self.records.append(message)


def varied(rng: random.Random, n: int, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_p=0.9),
             dict(temperature=1.0, top_k=20), dict(temperature=1.0, min_p=0.05),
             dict(temperature=0.0, top_logprobs_num=5), dict(temperature=1.0, seed=7)]
    out = []
    for i in range(n):
        length = int(math.exp(rng.uniform(0, math.log(6000))))
        out.append(([rng.randrange(vocab) for _ in range(length)],
                    SamplingParams(max_new_tokens=rng.randint(1, 32), ignore_eos=True, **kinds[i % len(kinds)])))
    return out


async def run(engine: Engine, requests) -> None:
    await asyncio.gather(*[engine.generate(p, sp) for p, sp in requests])


def measure(model: str, max_prefill_tokens: int, waves: int, per_wave: int) -> dict:
    slow = SlowSteps()
    logging.getLogger().addHandler(slow)
    before = compiled()  # (what earlier engines of this process compiled)
    t0 = time.perf_counter()
    engine = Engine(model, EngineConfig(device="cuda", num_pages=0, max_prefill_tokens=max_prefill_tokens),
                    dtype="bfloat16")
    phases = {"start": (time.perf_counter() - t0, compiled())}
    vocab = engine.model_config.vocab_size
    heap = contextlib.ExitStack()
    heap.enter_context(frozen_heap())  # (a full pass of the collector would hold a step: not a compile)
    t0 = time.perf_counter()
    asyncio.run(run(engine, [(list(range(16)), SamplingParams(max_new_tokens=4, temperature=0.0))]))
    phases["one short request"] = (time.perf_counter() - t0, compiled())
    slow.records.clear()
    rng = random.Random(0)
    for wave in range(waves):
        t0 = time.perf_counter()
        asyncio.run(run(engine, varied(rng, per_wave, vocab)))
        phases[f"varied wave {wave + 1}"] = (time.perf_counter() - t0, compiled())
    heap.close()
    engine.shutdown()
    logging.getLogger().removeHandler(slow)
    rows, seen = [], before
    for phase, (seconds, variants) in phases.items():
        new = {k: sorted(v - seen.get(k, set())) for k, v in variants.items() if v - seen.get(k, set())}
        rows.append({"phase": phase, "seconds": seconds, "new": new})
        seen = variants
    return {"max_prefill_tokens": max_prefill_tokens, "phases": rows, "slow_steps": slow.records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--max-prefill-tokens", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--per-wave", type=int, default=24)
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    print(f"## Triton compiles mid-run ({datetime.date.today()}, {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}, triton {triton.__version__}, {args.model})\n")
    results = []
    for budget in args.max_prefill_tokens:
        r = measure(args.model, budget, args.waves, args.per_wave)
        results.append(r)
        print(f"### engine.max_prefill_tokens={budget}\n\n| phase | s | kernels with new variants | new variants |\n"
              "|---|---|---|---|")
        for row in r["phases"]:
            print(f"| {row['phase']} | {row['seconds']:.1f} | {len(row['new'])} | "
                  f"{sum(len(v) for v in row['new'].values())} |")
        for row in r["phases"][2:]:
            for kernel, keys in row["new"].items():
                for key in keys:
                    print(f"- {row['phase']}: `{kernel}` {key[:300]}")
        print(f"\nslow steps after the short request: {len(r['slow_steps'])}")
        for message in r["slow_steps"][:20]:
            print(f"- {message}")
        print()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
