"""The engine's pause for a weight update with many requests running: what `Engine.load_paused` excludes from
generation per pause mode, against copying the same weights into the model alone, in one run.

    python benchmarks/engine_pause.py [--model tiny] [--device cpu] [--running 64] [--group 4] [--prompt 300]
                                      [--reps 5]

`--running` requests (long outputs) are all decoding before each update; as an RL group's do, each `--group` of
them share a prompt of `--prompt` tokens. Between updates the benchmark waits until they are all running again
(retract drops their KV, so they recompute first).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import sys
import time

import torch

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.model.loader import load_weights
from tandem.types import SamplingParams


async def all_running(engine: Engine, n: int) -> None:
    while (await engine.get_stats()).num_running < n:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # decoding, not just admitted


async def measure(engine: Engine, running: int, group: int, prompt: int, reps: int) -> dict[str, list[float]]:
    """Each mode gets requests of its own (an update marks requests' KV stale, which changes what the next one
    costs); `abort` ends them, so it starts a new set for every update."""
    named = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    sampling = SamplingParams(max_new_tokens=engine.max_context_len - prompt, ignore_eos=True)
    seconds: dict[str, list[float]] = {}
    for mode in ("copy alone", "retract", "in_place", "abort"):
        tasks = []
        for _ in range(reps):
            if not tasks or mode == "abort":
                tasks += [asyncio.create_task(engine.generate(list(range(2 + i // group, 2 + i // group + prompt)),
                                                              sampling)) for i in range(running)]
            await all_running(engine, running)
            if mode == "copy alone":  # from this thread while the engine steps: no pause, an upper bound
                t0 = time.perf_counter()
                load_weights(engine.model, named.items())
                if engine.model.lm_head.weight.is_cuda:
                    torch.cuda.synchronize()
                seconds.setdefault(mode, []).append(time.perf_counter() - t0)
            else:
                seconds.setdefault(mode, []).append(await engine.load_paused(named.items(), None, mode))
        engine.abort_all()
        await asyncio.gather(*tasks, return_exceptions=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=300)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    cfg = EngineConfig(device=args.device, max_running_requests=args.running,
                       num_pages=0 if args.device.startswith("cuda") else 16384)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    with Engine(args.model, cfg, dtype=dtype) as engine:
        seconds = asyncio.run(measure(engine, args.running, args.group, args.prompt, args.reps))
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"## engine pause ({datetime.date.today()}, {where}, torch {torch.__version__})")
    print(f"command: python {' '.join(sys.argv)}\n")
    print(f"{args.running} requests decoding before each update (groups of {args.group} sharing a prompt of "
          f"{args.prompt} tokens), model "
          f"{args.model}; median (min-max) over {args.reps} updates\n")
    print("| | ms |")
    print("|---|---|")
    for what, values in seconds.items():
        ms = [1e3 * v for v in values]
        print(f"| {what} | {statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) |")


if __name__ == "__main__":
    main()
