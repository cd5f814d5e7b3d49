"""Sync vs fully-async RL, same seed, same machine, one run; the weight sync against a plain broadcast.

    python benchmarks/async_speedup.py [section.key=value ...] [--model qwen3-0.6b] [--placement colocated shared]
                                       [--task random] [--steps 12] [--staleness 1 2 4]
                                       [--pause-modes retract in_place] [--batch-orders deadline admission]
                                       [--cache-max-ages 0 2] [--out results.json]

(overrides first: `--placement`, `--staleness`, `--pause-modes`, `--batch-orders` and `--cache-max-ages` take every
word after them)

Placement (one table each, in the order given): `colocated` runs the engine in a thread of the trainer's process (on
CUDA both on cuda:0, the engine on a stream of its own); `separate` runs the engine in a process of its own (on CUDA
the trainer on cuda:0 and the engine on cuda:1, weights over NCCL; on a CPU, gloo); `shared` runs it in a process of
its own on the trainer's device, weights handed over by reference (CUDA IPC; shared memory on a CPU). On CUDA the
engine sizes its KV pool from free memory (half of it when it shares the GPU). Synchronous RL is the same loop with
max_staleness = 0 (generate a batch, train, sync, repeat). `--task target_tokens` (or guess_number) trains a
learnable task at lr 1e-2, so the reward column shows learning; the default is the long-tailed random agent. Each
async staleness runs once per pause mode (default: the config's, `retract`): `retract` drops in-flight KV at every
update and recomputes it under the new weights (AReaL's interruptible rollouts), `in_place` keeps it (PipelineRL's
in-flight updates); the "prefill computed / trained token" column shows what the recompute costs. Likewise per batch
order (default: the config's, `deadline`): `deadline` lets short groups overtake a long one within the staleness
bound, `admission` trains groups in the order they were admitted, so a long episode holds its batch, and through the
bound the engine's admissions, back. And per prefix-cache age (`engine.prefix_cache_max_age`, default 0): N > 0
keeps KV up to N updates old in the prefix cache, so an episode's next turn need not prefill its history again after
every update.

Prints a markdown table: wall time per trained token, trained tokens/s and the speedup over sync, trainer and engine
idle fractions (the engine's: nothing to run, or paused; in brackets, its thread between steps: commands and its
loop, while the device may still run the step in flight), the engine's steps (what one costs, the share that only
decode, the commands that made the engine wait for its step in flight, requests running and waiting per step), the
episodes in flight on average (admitted, not ended: those not in the engine are between turns; in brackets the
share of the wall in which a group's slots were free but the staleness bound admitted none), the weight sync per
update (transfer ms and GB/s, the trainer's wait: mean and longest, engine pause ms; the handover as the one-GPU
target reads it: the trainer's wait median and longest, the pause median and longest, and when the engine had
applied the update, from the push's start: on one GPU the push returns once the load is queued), how often the
engine's loop was held past 200 ms by one step or command (any placement, from its stats; with colocated, the
reports from its log follow the table), the run's event loop and the interpreter's lock likewise (each report
after the table, placed in the step it fell in or after the last),
staleness (mean, max, and the share of trained tokens at each), prefix-cache reuse, and the reward of the first and
last quarter of the steps. With `separate`, also a plain broadcast of one update's bytes between the same two
devices with the same backend, measured in the same run: what the sync could reach; on one GPU, one
device-to-device copy of the same tensors. `--out`: every row's figures as JSON, written after each row.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import math
import os
import platform
import re
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.config import RunConfig, resolve_model
from tandem.model.qwen3 import Qwen3ForCausalLM
from tandem.run.loop import run_recording
from tandem.transport.dist import DistReceiver, DistSender

# the loop's engine_* counters reported per engine step
ENGINE_STEP_COUNTERS = ("busy_s", "forward_s", "schedule_s", "prepare_s", "postprocess_s", "decode_steps",
                        "running_request_steps", "waiting_request_steps", "command_waits")


class Holds(logging.Handler):
    """Collects the warnings of `logger` that report a hold past 200 ms: "tandem.engine.core", a step or command of
    the engine's loop (an engine in this process only: placement colocated); "tandem.run.loop_lag", the run's event
    loop, where every episode waits; "tandem.holds", the interpreter's lock kept (every thread of this process
    waited), with each thread's stack."""

    PHRASES = {"tandem.engine.core": "every request waited for it",
               "tandem.run.loop_lag": "every episode waited for it",
               "tandem.holds": "every thread of this process waited"}

    def __init__(self, logger: str):
        super().__init__(logging.WARNING)
        self.logger, self.phrase = logging.getLogger(logger), self.PHRASES[logger]
        self.ms: list[float] = []
        self.what: list[str] = []
        self.when: list[float] = []  # (`time.time()` of each warning: placed among the steps by `placed`)

    def emit(self, record: logging.LogRecord) -> None:
        if self.phrase in (message := record.getMessage()):
            self.what.append(message)
            self.when.append(record.created)
            self.ms.append(float(re.search(r"(?:took|held) (\d+) ms", message).group(1)))


def placed(holds: Holds, history: list[dict]) -> list[str]:
    """Each hold's report, prefixed with the step it fell in (the first whose record came after it), or "after
    the last step" (the run's end: its last checkpoint, the engine's stop), which no measured figure includes."""
    def step(t: float) -> str:
        return next((f"[in step {r['step']}]" for r in history if r["time"] >= t), "[after the last step]")
    return [f"{step(t)} {what}" for t, what in zip(holds.when, holds.what, strict=True)]


class Collections:
    """The garbage collector's passes in this process (they hold every thread, the engine's too when colocated)
    once the run has started (the placement froze the heap built until then: `freeze_heap`): how many, and the
    longest, by generation; and the longest before. It runs at every pass, so it must cost next to nothing:
    `gc.get_freeze_count` walks every frozen object, so it is asked only until the heap is frozen."""

    def __init__(self):
        self.started = 0.0
        self.frozen = False
        self.ms: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self.before_ms = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        ms = 1e3 * (time.perf_counter() - self.started)
        self.frozen = self.frozen or gc.get_freeze_count() > 0  # (cheap while nothing is frozen)
        if self.frozen:
            self.ms[info["generation"]].append(ms)
        else:
            self.before_ms = max(self.before_ms, ms)

    def summary(self) -> dict:
        return {**{f"gc{g}": (len(ms), max(ms, default=0.0)) for g, ms in self.ms.items()},
                "longest_before_start_ms": self.before_ms}


def measure(overrides: list[str], warmup: int) -> dict:
    """One run; rates and fractions over the steps after the first `warmup` (the first steps pay for CUDA
    kernels' first launches and the allocators' growth)."""
    slow, held, locked = Holds("tandem.engine.core"), Holds("tandem.run.loop_lag"), Holds("tandem.holds")
    collections = Collections()
    for holds in (slow, held, locked):
        holds.logger.addHandler(holds)
    gc.callbacks.append(collections)
    try:
        _, history, _ = run_recording(RunConfig.load(None, overrides))
    finally:
        for holds in (slow, held, locked):
            holds.logger.removeHandler(holds)
        gc.callbacks.remove(collections)
    gc.collect()  # (the run's objects go now, not at a later full pass: the next run's engine sizes its pool from
    # the memory left; a run is meant to hold no cycle, tests/test_run_release.py)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    first = history[warmup - 1] if warmup else dict.fromkeys(  # the counters before the first step
        ["wall_s", "prefill_tokens_computed", "engine_idle_s", *(f"engine_{k}" for k in ENGINE_STEP_COUNTERS),
         "engine_steps", "episode_seconds", "bound_seconds"], 0)
    steady = history[warmup:]
    last, quarter = history[-1], max(1, len(history) // 4)
    wall = last["wall_s"] - first["wall_s"]
    busy, idle = (last[f"engine_{k}_s"] - first[f"engine_{k}_s"] for k in ("busy", "idle"))
    tokens = sum(h["tokens_trained"] for h in steady)
    steps = max(1, last["engine_steps"] - first["engine_steps"])
    return {
        "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "us_per_token": 1e6 * wall / tokens,
        # the engine idle: nothing to run (or paused); between steps: its thread ran commands and its loop, while
        # the device may still run the step in flight
        "trainer_idle": sum(h["wait_s"] for h in steady) / wall, "engine_idle": idle / wall,
        # episodes admitted and not yet ended, on average (the engine runs or queues some; the rest are between turns)
        "episodes": (last["episode_seconds"] - first["episode_seconds"]) / wall,
        # the share of the wall in which a group's slots were free but the staleness bound admitted none
        "bound": (last["bound_seconds"] - first["bound_seconds"]) / wall,
        "engine_between": 1 - (busy + idle) / wall,
        "train_ms": 1e3 * statistics.median(h["train_s"] for h in steady),
        # the engine's prefill work per trained token: grows when updates make it recompute in-flight KV
        "prefill_per_token": (last["prefill_tokens_computed"] - first["prefill_tokens_computed"]) / tokens,
        # the engine's steps: what one costs (of it the forward pass), the share that only decode (CUDA graphs),
        # and the requests in each (its occupancy) and waiting for admission
        **{k: (last[f"engine_{k}"] - first[f"engine_{k}"]) / steps for k in ENGINE_STEP_COUNTERS},
        "transfer_ms": 1e3 * statistics.mean(h["transfer_s"] for h in steady),
        "transfer_wait_ms": 1e3 * statistics.mean(h["transfer_wait_s"] for h in steady),
        # the trainer's wait for its push: on one GPU until the load is queued to the engine (`tandem.run.pending`),
        # elsewhere the transfer, the load and the reply
        "sync_ms": 1e3 * statistics.mean(h["sync_s"] for h in steady),
        # from the push's start until the engine had applied it (= the trainer's wait where it waits for that)
        "applied_median_ms": 1e3 * statistics.median(applied(h) for h in steady),
        "applied_max_ms": 1e3 * max(applied(h) for h in steady),
        "sync_max_ms": 1e3 * max(h["sync_s"] for h in steady),
        "sync_gb_s": statistics.mean(h["sync_gb_per_s"] for h in steady), "sync_bytes": last["sync_bytes"],
        "pause_ms": 1e3 * statistics.mean(h["pause_s"] for h in steady),
        # the handover per update, as the one-GPU target reads it: the trainer's wait (its whole push: transfer,
        # the engine's load inside its pause, the reply) and the engine's pause, median and longest
        "handover_ms": 1e3 * statistics.median(h["sync_s"] for h in steady),
        "transfer_median_ms": 1e3 * statistics.median(h["transfer_s"] for h in steady),
        "pause_median_ms": 1e3 * statistics.median(h["pause_s"] for h in steady),
        "pause_max_ms": 1e3 * max(h["pause_s"] for h in steady),
        "sync_waits_ms": [1e3 * h["sync_s"] for h in history],  # every update's, warm-up included
        # the engine's loop held past 200 ms, over the whole run (its stats, any placement; the reports with the
        # steps' sizes and where it was held from its log, an engine in this process only)
        "slow_iterations": last.get("engine_slow_iterations", 0),
        "slowest_iteration_ms": 1e3 * last.get("engine_slowest_iteration_s", 0.0),
        "slow_iteration_reports": placed(slow, history)[:20],
        # the run's event loop held past 200 ms (every episode waited), over the whole run, where it was held
        "loop_holds": len(held.ms), "loop_longest_hold_ms": max(held.ms, default=0.0),
        "loop_hold_reports": placed(held, history)[:20],
        # the interpreter's lock kept past 200 ms (every thread of this process waited), with every thread's stack
        "interpreter_holds": len(locked.ms), "interpreter_hold_reports": placed(locked, history)[:20],
        # the collector's passes over the whole run: generation -> (count, longest ms)
        "gc": collections.summary(),
        "stale_mean": statistics.mean(h["staleness_mean"] for h in steady),
        "stale_max": max(h["staleness_max"] for h in steady),
        "stale_dist": distribution([h["staleness_tokens"] for h in steady]),
        "cache_hit": last["cache_hit_rate"],
        "reruns": f"{last['rerun_groups']} / {last['dropped_groups']}",  # (over the whole run, warm-up included)
        # the engine's prompt tokens served from its cache, against an unbounded cache (over the whole run)
        "reuse_vs_ideal": f"{last['cache_reuse_vs_ideal']:.0%}" if last["cache_reuse_vs_ideal"] is not None else "-",
        "reward_first": statistics.mean(h["reward_mean"] for h in history[:quarter]),
        "reward_last": statistics.mean(h["reward_mean"] for h in history[-quarter:]),
    }


def applied(record: dict) -> float:
    """Seconds from a step's push until the engine had applied its weights."""
    return record["applied_s"] if record.get("applied_s") is not None else record["sync_s"]


def distribution(counts: list[list[int]]) -> str:
    """Per-step token counts at staleness 0, 1, ... summed into shares: "60 / 30 / 10" (percent)."""
    total = [sum(c[k] for c in counts if k < len(c)) for k in range(max(map(len, counts), default=0))]
    return " / ".join(f"{100 * n / max(sum(total), 1):.0f}" for n in total) or "-"


def _bind(rank: int, devices: list[str]) -> torch.device:
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _broadcast_worker(rank: int, port: int, backend: str, devices: list[str], shapes: list, bucket_bytes: int,
                      reps: int, results):
    """One plain broadcast of all the bytes of `shapes`, timed as the sync's end to end (both start together,
    the sender's clock stops at the receiver's acknowledgement)."""
    device = _bind(rank, devices)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    num_bytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in shapes)
    data, flag = torch.empty(num_bytes, dtype=torch.uint8, device=device), torch.zeros(1, device=device)
    seconds = []
    for _ in range(reps + 1):  # the first one sets up the communicator
        dist.all_reduce(flag)  # both ranks start together
        t0 = time.perf_counter()
        dist.broadcast(data, src=0)
        dist.all_reduce(flag)  # ... and the receiver has it: as the sync's final acknowledgement
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - t0)
    if rank == 0:
        results.put(statistics.median(seconds[1:]))
    dist.destroy_process_group()


def _transport_worker(rank: int, port: int, backend: str, devices: list[str], shapes: list, bucket_bytes: int,
                      reps: int, results):
    """tandem's transport alone (`DistSender` to `DistReceiver`, no HTTP, no engine) on tensors of `shapes`."""
    device = _bind(rank, devices)
    url = f"tcp://127.0.0.1:{port}"
    if rank == 0:
        tensors = [(name, torch.randn(shape, device=device).to(dtype)) for name, shape, dtype in shapes]
        with DistSender(url, 2, 0, backend, 120, bucket_bytes, device=device if backend == "nccl" else None) as end:
            seconds = [end.send(tensors, version).seconds for version in range(reps + 1)]
        results.put(statistics.median(seconds[1:]))
    else:
        with DistReceiver(url, 2, 1, backend, 120, device=device if backend == "nccl" else None) as end:
            for _ in range(reps + 1):
                end.receive()


def two_process_gb_s(worker, shapes: list, bucket_bytes: int, backend: str, devices: list[str],
                     reps: int = 5) -> float:
    """GB/s of `worker` moving the bytes of `shapes` from devices[0] to devices[1] (two spawned processes), median
    of `reps` after one warm-up."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, port, backend, devices, shapes, bucket_bytes, reps, results))
             for rank in range(2)]
    for p in procs:
        p.start()
    try:
        num_bytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in shapes)
        return num_bytes / results.get(timeout=600) / 1e9
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def weight_shapes(model: str, dtype: torch.dtype) -> list[tuple[str, tuple, torch.dtype]]:
    """(name, shape, dtype) of what the trainer sends for `model` (a tied head once)."""
    with torch.device("meta"):
        net = Qwen3ForCausalLM(resolve_model(model)[0])
    return [(name, tuple(p.shape), dtype) for name, p in net.named_parameters()]


def devices_for(placement: str) -> tuple[str, str]:
    """(trainer device, engine device)."""
    if not torch.cuda.is_available():
        return "cpu", "cpu"
    if placement in ("colocated", "shared"):
        return "cuda:0", "cuda:0"
    if torch.cuda.device_count() < 2:
        sys.exit("--placement separate on CUDA needs two GPUs")
    return "cuda:0", "cuda:1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--placement", nargs="+", default=["colocated"], choices=["colocated", "separate", "shared"],
                        help="one table each, in this order")
    parser.add_argument("--task", default="random", choices=["random", "target_tokens", "guess_number"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--pause-modes", nargs="+", default=None, help="default: the config's rollout.pause_mode")
    parser.add_argument("--batch-orders", nargs="+", default=None, help="default: the config's rollout.batch_order")
    parser.add_argument("--cache-max-ages", type=int, nargs="+", default=None,
                        help="default: the config's engine.prefix_cache_max_age")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of rates and fractions")
    parser.add_argument("--out", default=None, help="also write every row's figures here (JSON)")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="the interpreter's thread switch interval for the whole run (default: Python's, 5 ms): "
                             "colocated, the engine's thread waits up to it for the GIL at each wake-up while the "
                             "trainer's thread runs Python")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup: must be in [0, --steps), got {args.warmup}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = (", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
              if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)")
    print(f"## async speedup ({datetime.date.today()}, {device}, Python {platform.python_version()}, "
          f"torch {torch.__version__})")
    print(f"command: python {' '.join(sys.argv)}")
    report = {"command": " ".join(sys.argv), "device": device, "torch": torch.__version__,
              "switch_interval_ms": 1e3 * sys.getswitchinterval(), "placements": {}}
    def save(placement: str, figures: dict) -> None:
        report["placements"][placement] = figures
        if args.out:  # after each row: a later one that fails (or a time limit) leaves the earlier ones' figures
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)

    for placement in args.placement:
        save(placement, run_placement(args, placement, save))


def run_placement(args, placement: str, save=lambda placement, figures: None) -> dict:
    """Sync, then every async variant, on one placement; prints its table. Returns its rows' figures; `save` gets
    them so far after each row."""
    out = tempfile.mkdtemp(prefix="tandem-bench-")
    trainer_device, engine_device = devices_for(placement)
    chosen = ["placement=separate", "weight_transport=ipc"] if placement == "shared" else [f"placement={placement}"]
    base = [f"model={args.model}", f"task={args.task}", f"steps={args.steps}", "seed=0", *chosen,
            f"trainer_device={trainer_device}", f"engine.device={engine_device}", "rollout.group_size=4",
            "rollout.batch_groups=4", "rollout.num_in_flight=64", "random_agent.response_len_median=16",
            "random_agent.response_len_sigma=1.2", "random_agent.response_len_max=512",
            "engine.measure_ideal_reuse=true",
            # no checkpoint mid-run: its cost, the same in every row, would dilute what this compares (the run's
            # end still writes one, after the last record)
            "checkpoint_every=0"]
    if engine_device != "cpu":  # bf16 weights and KV in the engine, bf16 compute over fp32 masters in the trainer
        base += ["engine.num_pages=0", f"engine.kv_memory_fraction={0.8 if placement == 'separate' else 0.5}",
                 "engine_dtype=bfloat16", "trainer.param_dtype=bfloat16"]
    if args.task != "random":
        base += ["trainer.lr=1e-2"]
    base += args.overrides
    cfg = RunConfig.load(None, base)
    print(f"\n### placement {placement}: trainer on {trainer_device}, engine on {engine_device}; task {args.task}, "
          f"model {args.model}\n")
    print(f"rates and fractions over steps {args.warmup + 1}-{args.steps} (the first {args.warmup} left out as "
          "warm-up); reward over all steps; each row printed as soon as it is measured\n")
    print("| mode | wall s | trained tokens | us / trained token | trained tok/s | speedup | trainer idle | "
          "engine idle (between steps) | engine ms / step (forward) | host ms / step: schedule, inputs, results | "
          "decode-only steps | commands waiting for a step / step | requests / step (waiting) | "
          "episodes in flight (admission held by the staleness bound) | "
          "prefill computed / trained token | train ms / step | "
          "transfer ms / update (waiting for the engine) | sync GB/s | trainer waits ms / update (longest) | "
          "pause ms / update | handover ms: trainer waits median (longest), pause median (longest), "
          "applied after median (longest) | "
          "engine loop held > 200 ms: times (longest ms) | staleness mean / max | "
          "tokens at staleness 0 / 1 / ... (%) | cache hit | reuse vs ideal | reward first -> last quarter | "
          "groups run again (engine unreachable) / dropped |")
    print("|---" * 28 + "|", flush=True)
    rows = []
    variants = [(mode, order, age) for mode in args.pause_modes or [cfg.rollout.pause_mode]
                for order in args.batch_orders or [cfg.rollout.batch_order]
                for age in args.cache_max_ages or [cfg.engine.prefix_cache_max_age]]
    for s, (mode, order, age) in [(0, variants[0])] + [(s, v) for v in variants for s in args.staleness]:
        t0 = time.perf_counter()
        r = measure([*base, f"rollout.max_staleness={s}", f"rollout.pause_mode={mode}", f"rollout.batch_order={order}",
                     f"engine.prefix_cache_max_age={age}", f"out_dir={out}/{s}{mode}{order}{age}"], args.warmup)
        kept = f", KV kept {age} update{'s' * (age > 1)}" if age else ""
        rows.append((f"async, max_staleness={s}, {mode}, {order} order{kept}" if s else "sync", r))
        r["speedup"] = r["tok_s"] / rows[0][1]["tok_s"]
        save(placement, {"rows": dict(rows), "partial": True})
        print(f"measured {rows[-1][0]} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        slow = f"{r['slow_iterations']} ({r['slowest_iteration_ms']:.0f})"
        print(f"| {rows[-1][0]} | {r['wall_s']:.1f} | {r['tokens']:.0f} | {r['us_per_token']:.0f} | "
              f"{r['tok_s']:.0f} | {r['speedup']:.2f}x | {r['trainer_idle']:.0%} | "
              f"{r['engine_idle']:.0%} ({r['engine_between']:.0%}) | "
              f"{1e3 * r['busy_s']:.2f} ({1e3 * r['forward_s']:.2f}) | "
              f"{1e3 * r['schedule_s']:.2f}, {1e3 * r['prepare_s']:.2f}, {1e3 * r['postprocess_s']:.2f} | "
              f"{r['decode_steps']:.0%} | {r['command_waits']:.2f} | "
              f"{r['running_request_steps']:.1f} ({r['waiting_request_steps']:.1f}) | {r['episodes']:.1f} "
              f"({r['bound']:.0%}) | "
              f"{r['prefill_per_token']:.2f} | {r['train_ms']:.0f} | "
              f"{r['transfer_ms']:.1f} ({r['transfer_wait_ms']:.1f}) | {r['sync_gb_s']:.3g} | "
              f"{r['sync_ms']:.1f} ({r['sync_max_ms']:.1f}) | {r['pause_ms']:.1f} | "
              f"{r['handover_ms']:.2f} ({r['sync_max_ms']:.2f}), "
              f"{r['pause_median_ms']:.2f} ({r['pause_max_ms']:.2f}), "
              f"{r['applied_median_ms']:.2f} ({r['applied_max_ms']:.2f}) | "
              f"{slow} | {r['stale_mean']:.2f} / {r['stale_max']:.0f} | "
              f"{r['stale_dist']} | "
              f"{r['cache_hit']:.0%} | {r['reuse_vs_ideal']} | {r['reward_first']:+.3f} -> {r['reward_last']:+.3f} | "
              f"{r['reruns']} |",
              flush=True)
    plain = alone = None
    if placement == "separate":
        backend = "nccl" if engine_device.startswith("cuda") else "gloo"
        shapes = weight_shapes(args.model, torch.bfloat16 if engine_device != "cpu" else torch.float32)
        devices = [trainer_device, engine_device]
        plain = two_process_gb_s(_broadcast_worker, shapes, cfg.weight_bucket_bytes, backend, devices)
        alone = two_process_gb_s(_transport_worker, shapes, cfg.weight_bucket_bytes, backend, devices)
    sync_bytes, idle_gb_s = rows[0][1]["sync_bytes"], rows[0][1]["sync_gb_s"]
    busy_gb_s = statistics.mean(r["sync_gb_s"] for _, r in rows[1:]) if rows[1:] else float("nan")
    copy_ms = None
    if plain is None:
        how = "by reference to the engine's process" if placement == "shared" else "in memory"
        if engine_device != "cpu":
            shapes = weight_shapes(args.model, torch.bfloat16)
            copy_ms = device_copy_ms(shapes, engine_device)
            plain_copy = f"; one device-to-device copy of the same tensors (one _foreach_copy_): {copy_ms:.2f} ms"
        else:
            plain_copy = ""
        print(f"\nweight sync: {sync_bytes / 1e6:.1f} MB per update, handed over {how} (placement {placement})"
              f"{plain_copy}")
        for name, r in rows:
            if r["slow_iteration_reports"]:
                print(f"engine loop held > 200 ms in {name}: " + "; ".join(r["slow_iteration_reports"][:5]))
    else:
        print(f"\nweight sync: {sync_bytes / 1e6:.1f} MB per update in buckets of {cfg.weight_bucket_bytes / 2**20:g} "
              f"MiB: {idle_gb_s:.3g} GB/s while the engine waits (sync), {busy_gb_s:.3g} GB/s while it generates "
              f"(async, mean); one plain {backend} broadcast of the same bytes between the same devices in this run: "
              f"{plain:.3g} GB/s ({idle_gb_s / plain:.0%} and {busy_gb_s / plain:.0%} of it); tandem's transport "
              f"alone (no HTTP, no engine) on tensors of the same shapes: {alone:.3g} GB/s ({alone / plain:.0%})")
    for name, r in rows:
        if r["loop_holds"]:
            print(f"the run's event loop held > 200 ms in {name}: {r['loop_holds']} times, longest "
                  f"{r['loop_longest_hold_ms']:.0f} ms: " + "; ".join(r["loop_hold_reports"][:3]))
        if r["interpreter_holds"]:
            print(f"the interpreter's lock kept > 200 ms in {name}: {r['interpreter_holds']} times: "
                  + " | ".join(r["interpreter_hold_reports"][:3]))
    for name, r in rows:  # a full pass holds every thread of the process: the engine's too when colocated
        print(f"garbage collections in {name} (this process, once started), count (longest ms) by generation: "
              + ", ".join(f"{g}: {r['gc'][g][0]} ({r['gc'][g][1]:.0f})" for g in ("gc0", "gc1", "gc2"))
              + f"; before: longest {r['gc']['longest_before_start_ms']:.0f} ms")
    return {"rows": {name: r for name, r in rows}, "device_copy_ms": copy_ms, "broadcast_gb_s": plain,
            "transport_alone_gb_s": alone}


def device_copy_ms(shapes: list, device: str, reps: int = 5) -> float:
    """Median ms of one `_foreach_copy_` of tensors of `shapes` into others on `device` (the floor of a handover)."""
    sources = [torch.randn(shape, device=device).to(dtype) for _, shape, dtype in shapes]
    dests = [torch.empty_like(t) for t in sources]
    ms = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch._foreach_copy_(dests, sources)
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end))
    del sources, dests
    torch.cuda.empty_cache()
    return statistics.median(ms[1:])


if __name__ == "__main__":
    main()
