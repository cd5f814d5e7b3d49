"""The weight sync alone, end to end: a trainer's weights into a running engine in its own process, the way a run
pushes them (the engine's HTTP call, buckets over NCCL or gloo, the load inside a pause), against one plain
broadcast of the same bytes between the same two devices, measured in the same run.

    python benchmarks/weight_sync.py [--model qwen3-8b] [--reps 5] [--busy 64] [section.key=value ...]

No trainer state is built, only its weights in the compute dtype (bf16 on CUDA), so shapes whose optimizer state
would not fit one GPU (8B: 16 GB of weights, 128 GB with fp32 masters and Adam) can be measured. On CUDA the
"trainer" is cuda:0 and the engine cuda:1; on a CPU both use gloo. `--busy N`: N requests keep generating (long
outputs, random prompts) through every sync, so the transfer competes with the engine's loop as in a run.
Prints, per sync: the transfer (until the engine holds every bucket), of it the wait for the engine's HTTP call,
and where the trainer's side went (the hello; gathering and flattening buckets; their metadata; starting their data;
waiting for a bucket's data before its memory is reused; the last buckets' data; the engines' confirmation),
the same transfer as the engine's receiver timed it (its hello to its last bucket) and where that went (the hello;
waiting for each bucket's metadata; allocating and starting each bucket; waiting for the data to land; the
acknowledgement), the pause (generation excluded), the sync as the trainer waited for it, and the
rest of that wait (the sync less the transfer and the pause: the engine's thread hops and its HTTP reply; in
brackets, of it the load's wait for the engine's thread to take it).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import statistics
import sys

import torch
from async_speedup import _broadcast_worker, devices_for, two_process_gb_s, weight_shapes

from tandem.config import RunConfig
from tandem.run.placement import Separate
from tandem.types import SamplingParams


async def syncs(cfg: RunConfig, named: list, reps: int, busy: int) -> list:
    placement = Separate(cfg)
    try:
        await placement.start(named, 0)
        vocab = placement.engine.model_config.vocab_size
        sampling = SamplingParams(max_new_tokens=placement.engine.max_context_len - 64, ignore_eos=True)
        rng = random.Random(0)
        load = [asyncio.create_task(placement.engine.generate([rng.randrange(vocab) for _ in range(64)], sampling))
                for _ in range(busy)]
        await asyncio.sleep(1.0 if busy else 0)  # the requests are decoding
        stats = []
        for version in range(1, reps + 2):  # the first push after start pays for first launches: left out
            stats.append(await placement.push(named, version))
        running = (await placement.engine.get_stats()).num_running
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)
        await placement.disconnect()
        return stats[1:], running
    finally:
        placement.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0, help="requests generating during the syncs")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    trainer_device, engine_device = devices_for("separate")
    cuda = engine_device != "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    base = [f"model={args.model}", "placement=separate", f"trainer_device={trainer_device}",
            f"engine.device={engine_device}", "engine_timeout_s=300", "weight_sync_timeout_s=120"]
    if cuda:
        base += ["engine.num_pages=0", "engine.kv_memory_fraction=0.5", "engine_dtype=bfloat16"]
    cfg = RunConfig.load(None, base + args.overrides)
    shapes = weight_shapes(args.model, dtype)
    num_bytes = sum(torch.Size(s).numel() * d.itemsize for _, s, d in shapes)
    backend = "nccl" if cuda else "gloo"
    print(f"## weight sync ({datetime.date.today()}, "
          f"{torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__})")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"model {args.model}: {num_bytes / 1e6:.1f} MB per update in buckets of "
          f"{cfg.weight_bucket_bytes / 2**20:g} MiB, {trainer_device} -> {engine_device} ({backend}), pause mode "
          f"{cfg.rollout.pause_mode}, {args.busy} requests generating\n", flush=True)
    plain_gb_s = two_process_gb_s(_broadcast_worker, shapes, cfg.weight_bucket_bytes, backend,
                                  [trainer_device, engine_device])
    torch.manual_seed(0)
    named = [(name, torch.randn(shape, device=trainer_device, dtype=dtype) * 0.02) for name, shape, _ in shapes]
    stats, running = asyncio.run(syncs(cfg, named, args.reps, args.busy))
    print("| sync | transfer ms (waiting for the engine) | of it: hello, flatten, metadata, post, reuse, land, done "
          "ms | the engine's receive ms | of it: hello, metadata, post, land, ack ms | GB/s | pause ms | "
          "sync ms | rest ms (of it: the load's wait for the engine's thread) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, s in enumerate(stats, 1):
        sent, received = (", ".join(f"{1e3 * v:.1f}" for v in phases.values()) or "-"
                          for phases in (s.sent.phases, s.reply.receive_phases))
        print(f"| {i} | {1e3 * s.transfer_s:.1f} ({1e3 * s.wait_s:.1f}) | {sent} | {1e3 * s.reply.transfer_s:.1f} | "
              f"{received} | {s.gb_per_s:.3g} | {1e3 * s.pause_s:.1f} | {1e3 * s.sync_s:.1f} | "
              f"{1e3 * (s.sync_s - s.transfer_s - s.pause_s):.1f} ({1e3 * (s.reply.load_s - s.pause_s):.1f}) |")
    median = statistics.median(s.transfer_s for s in stats)
    print(f"\nmedian transfer {1e3 * median:.1f} ms = {num_bytes / median / 1e9:.3g} GB/s; one plain {backend} "
          f"broadcast of the same bytes in this run: {plain_gb_s:.3g} GB/s ({1e3 * num_bytes / plain_gb_s / 1e9:.1f} "
          f"ms); the transfer reaches {num_bytes / median / 1e9 / plain_gb_s:.0%} of it. Requests still running "
          f"after the syncs: {running} of {args.busy}")


if __name__ == "__main__":
    main()
