"""What the tensor-parallel protections cost per engine step: the sampled-token broadcast and the lockstep
sentinel, switched on and off, on the same workload in one run.

    python benchmarks/tp_overhead.py [--tp 2] [--steps 400] [--batch 8] [--model tiny] [--device cpu]

Each configuration runs `batch` requests of `steps` tokens (pure decode after the first step) on a TP engine,
twice, and reports rank 0's mean step time over the second round (the first pays for kernels compiled on first
use). CPU/gloo by default; `--device cuda` uses NCCL for the model.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing
import os
import socket
import sys

import torch

from tandem.config import EngineConfig
from tandem.run.tp import engine_or_follow, init_tp
from tandem.types import SamplingParams


def _rank(rank, size, port, model, config, batch, steps, results):
    torch.set_num_threads(1)
    if config.device.startswith("cuda"):
        torch.cuda.set_device(rank)
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    tp = init_tp(rank, size, f"tcp://127.0.0.1:{port}", backend)
    engine = engine_or_follow(model, config, tp, dtype="bfloat16" if backend == "nccl" else None)
    if engine is None:
        return
    sp = SamplingParams(max_new_tokens=steps, temperature=1.0, ignore_eos=True)

    async def go():
        # a warm-up round first: it pays for kernels compiled on their first use (the prefill ones on CUDA)
        await asyncio.gather(*[engine.generate([1, 2, 3, i], sp) for i in range(batch)])
        before = await engine.get_stats()
        before = before.busy_seconds, before.num_steps
        await asyncio.gather(*[engine.generate([4, 5, 6, i], sp) for i in range(batch)])
        after = await engine.get_stats()
        return (after.busy_seconds - before[0]) / (after.num_steps - before[1])

    results.put(asyncio.run(go()))
    engine.shutdown()


def step_ms(size, model, config, batch, steps) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, size, port, model, config, batch, steps, results)) for r in range(size)]
    for p in procs:
        p.start()
    value = results.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return 1e3 * value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    rows = []
    for broadcast, sentinel in [(False, False), (True, False), (False, True), (True, True)]:
        config = EngineConfig(page_size=16, num_pages=512, device=args.device, token_broadcast=broadcast,
                              lockstep_sentinel=sentinel)
        rows.append((broadcast, sentinel, step_ms(args.tp, args.model, config, args.batch, args.steps)))
    base = rows[0][2]
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    print(f"## TP protections per step ({datetime.date.today()}, {where}, TP={args.tp}, tiny model, batch "
          f"{args.batch}, torch {torch.__version__})")
    print(f"command: python {' '.join(sys.argv)}\n")
    print("| token broadcast | sentinel | step ms | over neither |\n|---|---|---|---|")
    for broadcast, sentinel, ms in rows:
        print(f"| {'on' if broadcast else 'off'} | {'on' if sentinel else 'off'} | {ms:.3f} | {ms - base:+.3f} ms |")


if __name__ == "__main__":
    main()
