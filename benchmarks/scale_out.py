"""Scale-out: engine replicas behind the router, and one weight broadcast to all of them.

    python benchmarks/scale_out.py [--model small] [--replicas 1 2 4] [--steps 8] [--broadcast-mb 256] [--quick]

1. Runs: the random agent with 1, 2 and 4 engine replicas (processes of this host behind the router, placement
   separate with `rollout.num_engines`; one replica also through the router, `rollout.restart_engines=true`), the
   same workload each time: trained tokens per second and the engines' idle fraction (per engine), after `--warmup`
   steps.
2. The weight broadcast alone, to 1, 2 and 4 receivers (processes): tandem's transport (`DistSender`: one broadcast
   per bucket, the receivers' acknowledgements) against a plain torch.distributed broadcast of the same bytes in one
   tensor (then an all-reduce, so every receiver holds it), in the same processes, in the same run. gloo on a CPU,
   NCCL on GPUs (`--device cuda`: receiver i on cuda:i+1).
3. Arithmetic for 8 and 64 replicas on H200s: a pipelined broadcast (NCCL's ring or tree) moves the bytes once per
   link, so its time is bytes / link bandwidth plus a hop latency per replica; a send per replica costs N times the
   bytes. The bandwidths are assumptions, printed with the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import platform
import socket
import statistics
import time

import torch
import torch.distributed as dist
from async_speedup import weight_shapes

from tandem.config import RunConfig
from tandem.run.loop import run_recording
from tandem.transport.dist import DistReceiver, DistSender

RUN = ["placement=separate", "rollout.restart_engines=true", "rollout.group_size=4", "rollout.batch_groups=4",
       "rollout.num_in_flight=32", "rollout.max_staleness=2", "random_agent.max_context=512",
       "random_agent.prompt_len_max=64", "random_agent.response_len_max=128", "checkpoint_every=0"]
# assumptions for the arithmetic (GB/s a broadcast achieves per link, and the latency one more replica adds)
NVLINK_GB_S = 360.0  # one H200 node, NVLink 4 through NVSwitch (BENCHMARKS.md: a plain NCCL broadcast, 2 GPUs)
IB_GB_S = 45.0  # across nodes, one 400 Gb/s NDR port per GPU (50 GB/s line rate) at 90%
HOP_S = 20e-6  # per replica in the pipeline (NCCL's per-hop latency, an upper estimate)


def replica_runs(model: str, replicas: list[int], steps: int, warmup: int, overrides: list[str]) -> list[dict]:
    rows = []
    for n in replicas:
        cfg = RunConfig.load(None, [*RUN, f"model={model}", f"steps={steps}", f"rollout.num_engines={n}",
                                    f"out_dir=runs/scale_out/{n}", *overrides])
        _, history, _ = run_recording(cfg)
        first, last = history[warmup - 1] if warmup else None, history[-1]
        tokens = sum(h["tokens_trained"] for h in history[warmup:])
        wall = last["wall_s"] - (first["wall_s"] if first else 0.0)
        rows.append(dict(replicas=n, trained_tok_s=tokens / wall, engine_idle=last["engine_idle_frac"],
                         trainer_idle=last["trainer_idle_frac"], rerun_groups=last["rerun_groups"],
                         sync_ms=1e3 * statistics.median(h["transfer_s"] for h in history)))
        print(f"  {n} replica(s): {rows[-1]['trained_tok_s']:.0f} trained tok/s, engine idle "
              f"{rows[-1]['engine_idle']:.0%}, trainer idle {rows[-1]['trainer_idle']:.0%}", flush=True)
    return rows


def _broadcast_worker(rank: int, world: int, ports: tuple[int, int], shapes: list, bucket_bytes: int, reps: int,
                      device: str, results) -> None:
    """tandem's transport, then a plain broadcast of the same bytes, among the same `world` processes."""
    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    dev = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(dev)
    url = f"tcp://127.0.0.1:{ports[0]}"
    if rank == 0:
        tensors = [(name, torch.randn(shape, device=dev).to(dtype)) for name, shape, dtype in shapes]
        with DistSender(url, world, 0, backend, 300, bucket_bytes, device=dev if backend == "nccl" else None) as end:
            tandem = [end.send(tensors, version).seconds for version in range(reps + 1)][1:]
    else:
        with DistReceiver(url, world, rank, backend, 300, device=dev if backend == "nccl" else None) as end:
            for _ in range(reps + 1):
                end.receive()
                end.release()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=world)
    num_bytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in shapes)
    data, flag = torch.empty(num_bytes, dtype=torch.uint8, device=dev), torch.zeros(1, device=dev)
    plain = []
    for _ in range(reps + 1):
        dist.all_reduce(flag)  # every rank starts together
        t0 = time.perf_counter()
        dist.broadcast(data, src=0)
        dist.all_reduce(flag)  # ... and every receiver has it
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        plain.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    if rank == 0:
        results.put((statistics.median(tandem), statistics.median(plain[1:]), num_bytes))


def broadcast_times(receivers: int, shapes: list, bucket_bytes: int, reps: int, device: str) -> tuple:
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    world = receivers + 1
    procs = [ctx.Process(target=_broadcast_worker, daemon=True,
                         args=(rank, world, tuple(ports), shapes, bucket_bytes, reps, device, results))
             for rank in range(world)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=900)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def shapes_of(model: str, megabytes: float) -> list:
    """`model`'s tensors in bf16, in order, each taken while the total stays within `megabytes` (0: all)."""
    shapes, total = [], 0
    for name, shape, dtype in weight_shapes(model, torch.bfloat16):
        size = math.prod(shape) * dtype.itemsize
        if megabytes and total + size > megabytes * 1e6:
            continue  # (too big for what is left: a smaller one may fit)
        shapes.append((name, shape, dtype))
        total += size
    return shapes


def arithmetic(num_bytes: float) -> list[dict]:
    """Predicted seconds for one update of `num_bytes` to N replicas: a pipelined broadcast vs a send per replica."""
    rows = []
    for n, where, gb_s in ((8, "one node, NVLink", NVLINK_GB_S), (64, "8 nodes, InfiniBand", IB_GB_S)):
        broadcast = num_bytes / (gb_s * 1e9) + n * HOP_S
        rows.append(dict(replicas=n, link=where, gb_s=gb_s, broadcast_s=broadcast,
                         per_replica_sends_s=n * num_bytes / (gb_s * 1e9)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--broadcast-model", default="qwen3-0.6b", help="whose tensor shapes the broadcast moves")
    parser.add_argument("--broadcast-mb", type=float, default=256, help="of them, the first this many MB (0: all)")
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 steps, 64 MB broadcasts")
    parser.add_argument("--out", help="also write the results to this JSON file")
    parser.add_argument("overrides", nargs="*", help="section.key=value for the runs")
    args = parser.parse_args()
    if args.quick:
        args.model, args.steps, args.warmup, args.broadcast_mb, args.bucket_mb = "tiny", 4, 1, 64, 16
    print(f"# scale_out {datetime.date.today()} on {platform.node()} ({mp.cpu_count()} CPUs"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "") + ")")

    print(f"runs: model {args.model}, {args.steps} steps (rates after {args.warmup}), replicas {args.replicas}")
    runs = replica_runs(args.model, args.replicas, args.steps, args.warmup, args.overrides)

    shapes = shapes_of(args.broadcast_model, args.broadcast_mb)
    print(f"broadcasts: {len(shapes)} tensors of {args.broadcast_model} in bf16, buckets of {args.bucket_mb:g} MB, "
          f"median of {args.reps}")
    casts = []
    for n in args.replicas:
        tandem_s, plain_s, num_bytes = broadcast_times(n, shapes, int(args.bucket_mb * 1e6), args.reps, args.device)
        casts.append(dict(receivers=n, bytes=num_bytes, tandem_s=tandem_s, plain_s=plain_s))
        print(f"  to {n}: tandem {1e3 * tandem_s:.1f} ms ({num_bytes / tandem_s / 1e9:.2f} GB/s), plain broadcast "
              f"{1e3 * plain_s:.1f} ms ({num_bytes / plain_s / 1e9:.2f} GB/s): {plain_s / tandem_s:.0%}", flush=True)

    print("\n| replicas | trained tok/s | vs 1 | engine idle (per engine) | trainer idle | re-run groups |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['replicas']} | {r['trained_tok_s']:.0f} | {r['trained_tok_s'] / runs[0]['trained_tok_s']:.2f}x "
              f"| {r['engine_idle']:.0%} | {r['trainer_idle']:.0%} | {r['rerun_groups']} |")
    print("\n| receivers | MB | tandem ms | plain broadcast ms | tandem / plain | tandem vs 1 receiver |")
    print("|---|---|---|---|---|---|")
    for c in casts:
        print(f"| {c['receivers']} | {c['bytes'] / 1e6:.0f} | {1e3 * c['tandem_s']:.1f} | {1e3 * c['plain_s']:.1f} | "
              f"{c['tandem_s'] / c['plain_s']:.2f} | {c['tandem_s'] / casts[0]['tandem_s']:.2f}x |")
    predicted = {name: arithmetic(size) for name, size in (("qwen3-0.6b bf16", 1.19e9), ("qwen3-8b bf16", 16.4e9))}
    print(f"\narithmetic (assumed: NVLink {NVLINK_GB_S:g} GB/s, InfiniBand {IB_GB_S:g} GB/s per link, "
          f"{1e6 * HOP_S:g} us per replica in the pipeline)")
    print("| update | replicas | link | one broadcast | a send per replica |")
    print("|---|---|---|---|---|")
    for name, rows in predicted.items():
        for r in rows:
            print(f"| {name} | {r['replicas']} | {r['link']} | {1e3 * r['broadcast_s']:.1f} ms | "
                  f"{1e3 * r['per_replica_sends_s']:.0f} ms |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(runs=runs, broadcasts=casts, arithmetic=predicted, args=vars(args)), f, indent=2)


if __name__ == "__main__":
    main()
