"""Sync vs fully-async RL on the long-tailed random agent, same seed, same machine, one run.

    python benchmarks/async_speedup.py [--model tiny] [--steps 12] [--staleness 1 2 4] [section.key=value ...]

Synchronous RL is the same loop with max_staleness = 0 (generate a batch, train, sync, repeat). Prints a
markdown table: wall time per trained token, trained tokens/s and the speedup over sync, trainer and engine
idle fractions, engine pause per update, staleness, and prefix-cache reuse against the ideal.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile

import torch

from tandem.config import RunConfig
from tandem.run.loop import run_recording


def measure(overrides: list[str]) -> dict:
    _, history, trained = run_recording(RunConfig.load(None, overrides))
    episodes = [e for _, groups in trained for g in groups for e in g.episodes]
    last = history[-1]
    tokens = sum(h["tokens_trained"] for h in history)
    return {
        "wall_s": last["wall_s"], "tokens": tokens, "tok_s": tokens / last["wall_s"],
        "us_per_token": 1e6 * last["wall_s"] / tokens,
        "trainer_idle": last["trainer_idle_frac"], "engine_idle": last["engine_idle_frac"],
        "pause_ms": 1e3 * statistics.mean(h["pause_s"] for h in history),
        "stale_mean": statistics.mean(h["staleness_mean"] for h in history),
        "stale_max": max(h["staleness_max"] for h in history),
        "cache_hit": last["cache_hit_rate"],
        "reuse_vs_ideal": sum(e.cached_tokens for e in episodes) / max(1, sum(e.ideal_cached_tokens for e in episodes)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="tandem-bench-")
    base = [f"model={args.model}", f"steps={args.steps}", "seed=0", "rollout.group_size=4", "rollout.batch_groups=4",
            "rollout.num_in_flight=64", "random_agent.response_len_median=16", "random_agent.response_len_sigma=1.2",
            "random_agent.response_len_max=512", *args.overrides]
    rows = [("sync", measure([*base, "rollout.max_staleness=0", f"out_dir={out}/sync"]))]
    for s in args.staleness:
        row = measure([*base, f"rollout.max_staleness={s}", f"out_dir={out}/a{s}"])
        rows.append((f"async, max_staleness={s}", row))
    sync_tok_s = rows[0][1]["tok_s"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"## async speedup ({datetime.date.today()}, {device}, Python {platform.python_version()}, "
          f"torch {torch.__version__})")
    print(f"command: python {' '.join(sys.argv)}\n")
    print("| mode | wall s | trained tokens | us / trained token | trained tok/s | speedup | trainer idle | "
          "engine idle | pause ms / update | staleness mean / max | cache hit | reuse vs ideal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['wall_s']:.1f} | {r['tokens']:.0f} | {r['us_per_token']:.0f} | {r['tok_s']:.0f} | "
              f"{r['tok_s'] / sync_tok_s:.2f}x | {r['trainer_idle']:.0%} | {r['engine_idle']:.0%} | "
              f"{r['pause_ms']:.1f} | {r['stale_mean']:.2f} / {r['stale_max']:.0f} | {r['cache_hit']:.0%} | "
              f"{r['reuse_vs_ideal']:.0%} |")


if __name__ == "__main__":
    main()
