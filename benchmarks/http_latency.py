"""What the HTTP hop adds to the engine's calls: each call through `EngineClient` to a `ServerThread` (the way the
separate placement talks to its engine process), against the same call on the engine in process, in one run, on
an idle engine. Then what an agent's turn costs the engine's process in JSON, the standard library against
pydantic-core (which the server and the client use).

    python benchmarks/http_latency.py [--model tiny] [--reps 20]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import time
import timeit

import pydantic_core
import torch
from fastapi.responses import JSONResponse

from tandem.engine.client import EngineClient
from tandem.engine.engine import Engine
from tandem.server.http import ServerThread
from tandem.types import SamplingParams

ONE_TOKEN = SamplingParams(max_new_tokens=1)
HISTORY = [2 + i * 7 % 500 for i in range(2000)]


def calls(target) -> dict:
    return {
        "get_stats": target.get_stats,
        "generate (1 token)": lambda: target.generate([3, 4, 5], ONE_TOKEN),
        # an agent's later turn sends its whole history (prefix-cached here, so the engine's side stays small)
        "generate (2,000-token prompt, 1 token)": lambda: target.generate(HISTORY, ONE_TOKEN),
        "pause + resume": lambda: _pause_resume(target),
    }


def json_costs(reps: int = 200) -> list[tuple[str, float, float]]:
    """What an agent's turn costs the engine's process in JSON, the standard library's way (`json.loads`, and
    `JSONResponse`'s `json.dumps`) against pydantic-core's (what the server and the client use)."""
    request = json.dumps({"input_ids": HISTORY, "sampling_params": {"max_new_tokens": 512}}).encode()
    reply = {"output_ids": HISTORY[:512], "meta_info": {"output_token_logprobs": [[-1.25 - i / 1e3, t, None] for i, t
                                                                                  in enumerate(HISTORY[:512])]}}
    work = {"parse a request with a 2,000-token history": (lambda: json.loads(request),
                                                           lambda: pydantic_core.from_json(request)),
            "serialise a 512-token reply with logprobs": (lambda: JSONResponse(reply).body,
                                                          lambda: pydantic_core.to_json(reply, inf_nan_mode="null"))}
    rows = []
    for name, (stdlib, rust) in work.items():
        same = [json.loads(x) if isinstance(x, bytes) else x for x in (stdlib(), rust())]
        assert same[0] == same[1], f"{name}: the two give different results"
        rows.append((name, *(1e6 * timeit.timeit(f, number=reps) / reps for f in (stdlib, rust))))
    return rows


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
    print("\n| JSON work per turn | json us | pydantic-core us | ratio |\n|---|---|---|---|")
    for name, stdlib, rust in json_costs():
        print(f"| {name} | {stdlib:.0f} | {rust:.0f} | {stdlib / rust:.1f}x |")


if __name__ == "__main__":
    main()
