"""The host time a step's scheduling takes while the KV pool is full of cached prefixes, with eviction freeing at
least `radix_cache.EVICT_FRACTION` of the pool at a time against only the pages each allocation asks for: the same
requests in the same run, the scheduler and the radix cache over a bare page allocator (no model, no device).

    python benchmarks/schedule_cost.py [--pages 34907] [--page-size 16] [--cached 2500] [--prompt 512]
                                       [--requests 128] [--tokens 256]

First `--cached` requests of `--prompt` distinct tokens run to completion one token each, which leaves the pool
full of their cached prefixes (34,907 pages: the 0.6B engine's pool on an H100); then `--requests` requests of
100-token prompts decode `--tokens` tokens each, taking a page every `--page-size` tokens, so that the steps evict
as they go. Printed: the mean and longest schedule of those decode steps, the evictions, and the ratio.
"""

from __future__ import annotations

import argparse
import random
import time

from tandem.config import EngineConfig
from tandem.engine import radix_cache
from tandem.engine.kv_pool import PageAllocator
from tandem.engine.radix_cache import RadixCache
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler
from tandem.types import SamplingParams


class Pool(PageAllocator):
    def copy_slots(self, *args) -> None:  # (a partially matched page's copy: no storage here)
        pass


def run(args, fraction: float) -> dict:
    """Fill the cache, then time the decode steps' schedules with `EVICT_FRACTION` = fraction."""
    radix_cache.EVICT_FRACTION = fraction
    pool = Pool(args.pages, args.page_size)
    cache = RadixCache(pool)
    sched = Scheduler(pool, cache, EngineConfig(page_size=args.page_size, num_pages=args.pages,
                                                max_prefill_tokens=8192, max_running_requests=256))
    evictions, evict = [], cache.evict
    cache.evict = lambda n: evictions.append(n) or evict(n)
    rng, arrivals = random.Random(0), iter(range(10**9))

    def add(prompt: list[int], new: int) -> None:
        rid = next(arrivals)
        sched.waiting.append(Request(f"r{rid}", prompt, len(prompt), SamplingParams(max_new_tokens=new), seed=0,
                                     arrival=rid))

    def step() -> float:
        start = time.perf_counter()
        chunks = sched.schedule()
        spent = time.perf_counter() - start
        sched.advance(chunks)
        for c in chunks:
            if c.sample and (reason := sched.resolve(c.req, len(c.req.tokens) - 1, rng.randrange(1000), 0.0, 0)):
                sched.finish(c.req, reason)
        return spent

    for i in range(args.cached):
        add([1_000_000 * (i + 1) + j for j in range(args.prompt)], 1)
    while sched.waiting or sched.running:
        step()
    nodes = len(cache._nodes())
    evictions.clear()
    for i in range(args.requests):
        add([2_000_000_000 + 1_000 * i + j for j in range(100)], args.tokens)
    times = []
    while sched.waiting or sched.running:
        times.append(step())
    decode = times[-args.tokens // 2:]  # (the steps after every prefill, all decodes)
    return {"nodes": nodes, "mean_ms": 1e3 * sum(decode) / len(decode), "max_ms": 1e3 * max(decode),
            "evictions": len(evictions), "pages_asked": sum(evictions)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=34907)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--cached", type=int, default=2500)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    default = radix_cache.EVICT_FRACTION
    rows = [("only the pages asked for (before)", run(args, 0.0)),
            (f"at least {default:.4f} of the pool", run(args, default))]
    print(f"## schedule cost with a full prefix cache ({args.pages:,} pages of {args.page_size}; {args.requests} "
          f"requests decoding {args.tokens} tokens)\n\n| eviction frees | tree nodes | decode step's schedule, mean ms "
          "| longest ms | evictions | pages asked |\n|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['nodes']:,} | {r['mean_ms']:.3f} | {r['max_ms']:.2f} | {r['evictions']:,} | "
              f"{r['pages_asked']:,} |")
    print(f"\nmean schedule, before / now: {rows[0][1]['mean_ms'] / rows[1][1]['mean_ms']:.1f}x")


if __name__ == "__main__":
    main()
