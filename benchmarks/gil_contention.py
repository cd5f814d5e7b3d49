"""The engine's step beside another thread of its process that runs Python (as the colocated trainer's does), at
several thread switch intervals: each time the engine's thread wants the GIL back (after every call that released
it) it may wait up to the interval. Prints ms per engine step alone and beside the busy thread, and how much Python
the busy thread got done (thousands of loops per second).

    python benchmarks/gil_contention.py [--model tiny] [--device cpu] [--intervals-ms 5 0.5 0.2] [--out f.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.types import SamplingParams


def spin(stop: threading.Event, loops: list[int]) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i
        loops[0] += 1


async def generate(engine: Engine, requests: int, tokens: int) -> float:
    sampling = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    await asyncio.gather(*[engine.generate([3 + i, 5, 7, 9] * 20, sampling) for i in range(requests)])
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--intervals-ms", type=float, nargs="+", default=[5.0, 0.5, 0.2])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    saved, rows = sys.getswitchinterval(), []
    with Engine(args.model, EngineConfig(device=args.device)) as engine:
        asyncio.run(generate(engine, args.requests, args.tokens))  # first launches
        for interval in [None, *args.intervals_ms]:
            sys.setswitchinterval(saved if interval is None else interval / 1e3)
            stop, loops = threading.Event(), [0]
            busy = threading.Thread(target=spin, args=(stop, loops), daemon=True)
            if interval is not None:
                busy.start()
            steps0 = engine.core.stats.num_steps
            seconds = asyncio.run(generate(engine, args.requests, args.tokens))
            stop.set()
            if interval is not None:
                busy.join()
            steps = engine.core.stats.num_steps - steps0
            rows.append({"busy_thread": interval is not None, "switch_interval_ms": 1e3 * sys.getswitchinterval(),
                         "ms_per_step": 1e3 * seconds / steps, "busy_kloops_per_s": loops[0] / seconds / 1e3})
            r = rows[-1]
            print(f"{'beside a thread running Python' if r['busy_thread'] else 'alone'}, switch interval "
                  f"{r['switch_interval_ms']:g} ms: {r['ms_per_step']:.1f} ms per engine step; the busy thread "
                  f"{r['busy_kloops_per_s']:.1f} k loops/s", flush=True)
    sys.setswitchinterval(saved)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
