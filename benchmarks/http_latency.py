"""What the HTTP hop adds to the engine's calls: each call through `EngineClient` to a `ServerThread` (the way the
separate placement talks to its engine process), against the same call on the engine in process, in one run, on
an idle engine.

    python benchmarks/http_latency.py [--model tiny] [--reps 20]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import sys
import time

import torch

from tandem.engine.client import EngineClient
from tandem.engine.engine import Engine
from tandem.server.http import ServerThread
from tandem.types import SamplingParams

ONE_TOKEN = SamplingParams(max_new_tokens=1)


def calls(target) -> dict:
    return {
        "get_stats": target.get_stats,
        "generate (1 token)": lambda: target.generate([3, 4, 5], ONE_TOKEN),
        "pause + resume": lambda: _pause_resume(target),
    }


async def _pause_resume(target) -> None:
    await target.pause("in_place")
    await target.resume()


async def median_ms(call, reps: int) -> float:
    await call()  # connections and first launches
    seconds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        await call()
        seconds.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(seconds)


async def measure(engine: Engine, client: EngineClient, reps: int) -> list[tuple[str, float, float]]:
    try:
        return [(name, await median_ms(direct, reps), await median_ms(over_http, reps))
                for (name, direct), over_http in zip(calls(engine).items(), calls(client).values(), strict=True)]
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    with Engine(args.model) as engine, ServerThread(engine) as server:
        rows = asyncio.run(measure(engine, EngineClient(server.url).connect(), args.reps))
    print(f"## engine calls over HTTP ({datetime.date.today()}, CPU, torch {torch.__version__})")
    print(f"command: python {' '.join(sys.argv)}\n")
    print("| call | in process ms | over HTTP ms | added ms |")
    print("|---|---|---|---|")
    for name, direct, over_http in rows:
        print(f"| {name} | {direct:.2f} | {over_http:.2f} | {over_http - direct:.2f} |")


if __name__ == "__main__":
    main()
