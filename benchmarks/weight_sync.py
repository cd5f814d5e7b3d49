"""The weight sync alone, end to end: a trainer's weights into a running engine, the way a run pushes them, against
what the bytes alone take, measured in the same run. `--placement separate` (the default): the engine in its own
process on another GPU (the engine's HTTP call, buckets over NCCL or gloo, the load inside a pause), against one
plain broadcast of the same bytes between the same two devices. `--placement colocated shared`: the two one-GPU
placements (the engine a thread of this process, weights handed over in memory; the engine in its own process on
the same GPU, weights by reference, CUDA IPC), against one device-to-device copy of the same tensors.

    python benchmarks/weight_sync.py [--model qwen3-8b] [--placement separate] [--reps 5] [--busy 64] [--out f.json]
                                     [section.key=value ...]

No trainer state is built, only its weights in the compute dtype (bf16 on CUDA), so shapes whose optimizer state
would not fit one GPU (8B: 16 GB of weights, 128 GB with fp32 masters and Adam) can be measured. On CUDA the
"trainer" is cuda:0 and the engine cuda:1 (separate), or both cuda:0; on a CPU both use gloo (separate). `--busy N`:
N requests keep generating (long outputs, random prompts) through every sync, so the transfer competes with the
engine's loop as in a run. Prints, per sync: the transfer (until the engine holds every bucket), of it the wait for
the engine's HTTP call, and where the trainer's side went (the hello; gathering and flattening buckets; their
metadata; starting their data; waiting for a bucket's data before its memory is reused; the last buckets' data; the
engines' confirmation), the same transfer as the engine's receiver timed it (its hello to its last bucket) and where
that went (the hello; waiting for each bucket's metadata; allocating and starting each bucket; waiting for the data
to land; the acknowledgement), the pause (generation excluded), what the trainer waited for (the push: on one GPU
until the load is queued to the engine, elsewhere until the engine holds the weights; and the fence its next write
into the weights waits for, 50 ms later as a step would be, see `tandem.run.pending`), when the engine had applied
it (from the push's start), and the engine's gap (from the load's start to the launch of its first step on the new
weights; shared: reported by the next load). Then, per placement, medians and longest. `--out`: the figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import random
import statistics
import sys
import time

import torch
from async_speedup import _broadcast_worker, device_copy_ms, devices_for, two_process_gb_s, weight_shapes

from tandem.config import RunConfig
from tandem.run.placement import place
from tandem.types import SamplingParams


async def syncs(cfg: RunConfig, named: list, reps: int, busy: int) -> tuple[list, int]:
    """`reps` pushes as a run makes them (`Placement.send`, then the trainer's fence before its next write, 50 ms
    later), the first one after start left out; per push: its stats, the fence's wait, the engine's gap."""
    placement = place(cfg)
    try:
        await placement.start(named, 0)
        vocab = placement.engine.model_config.vocab_size
        sampling = SamplingParams(max_new_tokens=placement.engine.max_context_len - 64, ignore_eos=True)
        rng = random.Random(0)
        load = [asyncio.create_task(placement.engine.generate([rng.randrange(vocab) for _ in range(64)], sampling))
                for _ in range(busy)]
        await asyncio.sleep(1.0 if busy else 0)  # the requests are decoding
        out = []
        core = getattr(placement.engine, "core", None)  # (colocated: the engine's own figures)
        for version in range(1, reps + 2):  # the first push after start pays for first launches: left out
            pending = await placement.send(named, version)
            stats = await pending.applied()
            await asyncio.sleep(0.05)  # the engine generates meanwhile, as it does while the trainer trains
            t0 = time.perf_counter()
            pending.fence()  # the trainer's next write into its weights waits for the engine's reads
            fence_s = time.perf_counter() - t0
            gap_s = core.load_gap_s if core is not None else None
            out.append((stats, fence_s, gap_s))
        if core is None:  # (shared) each reply carries the gap of the load before it
            gaps = [s.reply.receive_phases.get("previous_load_gap") for s, _, _ in out[1:]] + [None]
            out = [(s, f, g) for (s, f, _), g in zip(out, gaps, strict=True)]
        running = (await placement.engine.get_stats()).num_running
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)
        await placement.disconnect()
        return out[1:], running
    finally:
        placement.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--placement", nargs="+", default=["separate"], choices=["separate", "colocated", "shared"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0, help="requests generating during the syncs")
    parser.add_argument("--out", default=None, help="also write the figures here (JSON)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = weight_shapes(args.model, dtype)
    num_bytes = sum(torch.Size(s).numel() * d.itemsize for _, s, d in shapes)
    print(f"## weight sync ({datetime.date.today()}, "
          f"{torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__})")
    print(f"command: python {' '.join(sys.argv)}")
    report = {"command": " ".join(sys.argv), "num_bytes": num_bytes, "placements": {}}
    for placement in args.placement:
        report["placements"][placement] = measure(args, placement, shapes, num_bytes)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)


def measure(args, placement: str, shapes: list, num_bytes: int) -> dict:
    trainer_device, engine_device = devices_for(placement)
    cuda = engine_device != "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    chosen = ["placement=separate", "weight_transport=ipc"] if placement == "shared" else [f"placement={placement}"]
    base = [f"model={args.model}", *chosen, f"trainer_device={trainer_device}", f"engine.device={engine_device}",
            "engine_timeout_s=300", "weight_sync_timeout_s=120"]
    if cuda:
        base += ["engine.num_pages=0", "engine.kv_memory_fraction=0.5", "engine_dtype=bfloat16"]
    cfg = RunConfig.load(None, base + args.overrides)
    backend = "nccl" if cuda else "gloo"
    how = (f"in buckets of {cfg.weight_bucket_bytes / 2**20:g} MiB, {trainer_device} -> {engine_device} ({backend})"
           if placement == "separate" else f"handed over on {engine_device}")
    print(f"\n### placement {placement}: model {args.model}, {num_bytes / 1e6:.1f} MB per update {how}, pause mode "
          f"{cfg.rollout.pause_mode}, {args.busy} requests generating\n", flush=True)
    if placement == "separate":
        plain_gb_s = two_process_gb_s(_broadcast_worker, shapes, cfg.weight_bucket_bytes, backend,
                                      [trainer_device, engine_device])
        plain_ms = 1e3 * num_bytes / plain_gb_s / 1e9
    else:
        plain_ms = device_copy_ms(shapes, engine_device) if cuda else None
    torch.manual_seed(0)
    named = [(name, torch.randn(shape, device=trainer_device, dtype=dtype) * 0.02) for name, shape, _ in shapes]
    results, running = asyncio.run(syncs(cfg, named, args.reps, args.busy))
    del named
    gc.collect()  # (the placement's objects go now: the next placement's engine sizes its pool from what is left)
    if cuda:
        torch.cuda.empty_cache()
    print("| sync | transfer ms (waiting for the engine) | of it, by phase ms | the engine's receive ms | "
          "of it, by phase ms | GB/s | pause ms | trainer waits ms: push + fence | applied ms | engine gap ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    waits, pauses, applied, gaps = [], [], [], []
    for i, (s, fence_s, gap_s) in enumerate(results, 1):
        sent, received = (", ".join(f"{k} {1e3 * v:.1f}" for k, v in phases.items() if k != "previous_load_gap")
                          or "-" for phases in (s.sent.phases, s.reply.receive_phases))
        waits.append(1e3 * (s.sync_s + fence_s))
        pauses.append(1e3 * s.pause_s)
        applied.append(1e3 * (s.applied_s if s.applied_s is not None else s.sync_s))
        gaps.append(None if gap_s is None else 1e3 * gap_s)
        print(f"| {i} | {1e3 * s.transfer_s:.1f} ({1e3 * s.wait_s:.1f}) | {sent} | {1e3 * s.reply.transfer_s:.1f} | "
              f"{received} | {s.gb_per_s:.3g} | {1e3 * s.pause_s:.2f} | {1e3 * s.sync_s:.2f} + {1e3 * fence_s:.2f} | "
              f"{applied[-1]:.2f} | {'-' if gap_s is None else f'{1e3 * gap_s:.2f}'} |")
    known = [g for g in gaps if g is not None]
    gap_text = f"{statistics.median(known):.2f} ms (longest {max(known):.2f})" if known else "not measured"
    print(f"\nthe trainer waits {statistics.median(waits):.2f} ms per update (median; longest {max(waits):.2f}: the "
          f"push, until the load is queued to the engine, and the fence before its next write); the engine applies "
          f"it {statistics.median(applied):.2f} ms after the push started (median; longest {max(applied):.2f}); it "
          f"pauses {statistics.median(pauses):.2f} ms (longest {max(pauses):.2f}); its gap from the load's start to "
          f"its first step on the new weights: {gap_text}. Requests still running after the syncs: {running} of "
          f"{args.busy}")
    if plain_ms is not None:
        what = f"one plain {backend} broadcast" if placement == "separate" else "one device-to-device copy"
        print(f"{what} of the same bytes in this run: {plain_ms:.2f} ms")
    return {"pause_mode": cfg.rollout.pause_mode, "trainer_wait_ms": waits, "pause_ms": pauses,
            "applied_ms": applied, "engine_gap_ms": gaps,
            "transfer_ms": [1e3 * s.transfer_s for s, _, _ in results],
            "trainer_wait_median_ms": statistics.median(waits), "trainer_wait_max_ms": max(waits),
            "applied_median_ms": statistics.median(applied),
            "engine_gap_median_ms": statistics.median(known) if known else None,
            "pause_median_ms": statistics.median(pauses), "pause_max_ms": max(pauses), "plain_ms": plain_ms,
            "running_after": running}


if __name__ == "__main__":
    main()
