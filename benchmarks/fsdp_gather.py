"""Gathering an FSDP trainer's full weights for the engine (what each push under `trainer.fsdp` does first): one
all-gather a parameter (each DTensor's `full_tensor()`, as before `parallel.gathered`) against a bucket of
parameters a gather, in the same run, on `--ranks` processes (gloo on CPUs, NCCL on GPUs, one each).

    python benchmarks/fsdp_gather.py [--model small] [--ranks 2] [--reps 3] [--bucket-mb 32 256]

Prints, per way, the median wall time of a whole gather over `--reps` (after one warm-up) and the bytes of full
weights gathered per second; the ways take turns within each repetition.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.config import LossConfig, TrainerConfig
from tandem.model.loader import build_model
from tandem.trainer import parallel
from tandem.trainer.trainer import Trainer
from tandem.transport.dist import rendezvous


def per_parameter(trainer: Trainer):
    for name, p in trainer.model.named_parameters():
        yield name, p.detach().to(trainer.param_dtype).full_tensor()


def rank_main(rank: int, args, address: tuple[str, int]) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    store = dist.TCPStore(*address, None, False, datetime.timedelta(seconds=120))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=args.ranks)
    device = f"cuda:{rank}" if cuda else "cpu"
    trainer = Trainer(build_model(args.model, device=device, dtype="float32", seed=0),
                      TrainerConfig(fsdp=True, param_dtype="bfloat16"), LossConfig())
    ways = {"a parameter a gather": lambda: per_parameter(trainer)}
    for mb in args.bucket_mb:
        ways[f"{mb} MiB a gather"] = lambda mb=mb: parallel.gathered(trainer.model.named_parameters(),
                                                                     trainer.param_dtype, mb << 20)
    times = {way: [] for way in ways}
    nbytes = 0
    for rep in range(args.reps + 1):
        for way, gather in ways.items():
            dist.barrier()
            t0 = time.perf_counter()
            nbytes = sum(t.numel() * t.element_size() for _, t in gather())
            if cuda:
                torch.cuda.synchronize()
            if rep:
                times[way].append(time.perf_counter() - t0)
    if rank == 0:
        base = statistics.median(times["a parameter a gather"])
        print(f"## {args.model}: {nbytes / 1e6:.1f} MB of full weights over {args.ranks} ranks "
              f"({'NCCL' if cuda else 'gloo'}), median of {args.reps}\n")
        print("| way | ms | GB/s | speed-up |\n|---|---|---|---|")
        for way, ts in times.items():
            t = statistics.median(ts)
            print(f"| {way} | {t * 1e3:.1f} | {nbytes / t / 1e9:.2f} | {base / t:.1f}x |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[parallel.GATHER_BUCKET_BYTES >> 20, 256])
    args = parser.parse_args()
    store = rendezvous("127.0.0.1", 120)  # (held until the ranks are done)
    mp.spawn(rank_main, args=(args, (store.host, store.port)), nprocs=args.ranks)


if __name__ == "__main__":
    main()
