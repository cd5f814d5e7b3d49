"""`tandem run`: the RL loop with a live display, metrics as JSON lines, a checkpoint on exit."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from rich.console import Console
from rich.live import Live
from rich.table import Table

from tandem.config import RunConfig
from tandem.run.loop import Run

COLUMNS = [("step", "step", "{:.0f}"), ("version", "ver", "{:.0f}"), ("in_flight_episodes", "in flight", "{:.0f}"),
           ("buffered_groups", "buffer", "{:.0f}"), ("reward_mean", "reward", "{:+.3f}"),
           ("staleness_mean", "stale", "{:.2f}"), ("staleness_max", "max", "{:.0f}"),
           ("trained_tokens_per_s", "train tok/s", "{:.0f}"), ("rollout_tokens_per_s", "gen tok/s", "{:.0f}"),
           ("cache_hit_rate", "cache hit", "{:.0%}"), ("cache_reuse_vs_ideal", "of ideal", "{:.0%}"),
           ("mismatch_kl", "mism. KL", "{:+.1e}"),
           ("clip_frac", "clip", "{:.2f}"), ("transfer_s", "sync ms", "{:.1f}"), ("pause_s", "pause ms", "{:.1f}"),
           ("wait_s", "wait s", "{:.2f}")]
MILLISECONDS = {"transfer_s", "pause_s"}


def _table(records: list[dict], last: int = 12) -> Table:
    table = Table(title="tandem run", expand=False)
    for _, title, _ in COLUMNS:
        table.add_column(title, justify="right")
    for r in records[-last:]:
        cells = []
        for key, _, fmt in COLUMNS:
            value = r.get(key)
            value = value * 1e3 if key in MILLISECONDS and value is not None else value
            cells.append(fmt.format(value) if value is not None else "-")
        table.add_row(*cells)
    return table


def _tensorboard(cfg: RunConfig):
    if not cfg.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("run.tensorboard: needs the tensorboard package (pip install tensorboard)") from None
    return SummaryWriter(cfg.out_dir)


def run_with_display(cfg: RunConfig, console: Console) -> list[dict]:
    """One run with the live table; Ctrl-C stops it cleanly (the loop saves a checkpoint)."""
    console.print(f"[bold]tandem run[/]: task={cfg.task} model={cfg.model} steps={cfg.steps} "
                  f"max_staleness={cfg.rollout.max_staleness} pause_mode={cfg.rollout.pause_mode} "
                  f"placement={cfg.placement} (trainer on {cfg.trainer_device or cfg.engine.device}, engine on "
                  f"{cfg.engine.device}) out_dir={cfg.out_dir}")
    writer = _tensorboard(cfg)
    run = Run(cfg)
    run.out_dir.mkdir(parents=True, exist_ok=True)
    (run.out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    records: list[dict] = []
    try:
        with Live(_table(records), console=console, refresh_per_second=4) as live:
            def on_step(record):
                records.append(record)
                live.update(_table(records))
                for key, value in record.items():
                    if writer is not None and isinstance(value, int | float):
                        writer.add_scalar(key, value, record["step"])

            asyncio.run(run.train(on_step))
    except KeyboardInterrupt:
        console.print(f"interrupted: checkpoint saved in {run.out_dir}")
    finally:
        run.shutdown()
        if writer is not None:
            writer.close()
    if records:
        first, last = records[0], records[-1]
        console.print(f"\ndone: {last['step']} steps in {last['wall_s']:.1f} s; reward {first['reward_mean']:+.3f} -> "
                      f"{last['reward_mean']:+.3f}; {last['trained_tokens_per_s']:.0f} trained tok/s; trainer idle "
                      f"{last['trainer_idle_frac']:.0%}, engine idle {last['engine_idle_frac']:.0%}; weight sync "
                      f"{1e3 * last['transfer_s']:.1f} ms ({last['sync_gb_per_s']:.2f} GB/s), generation paused "
                      f"{1e3 * last['pause_s']:.1f} ms; dropped groups {last['dropped_groups']}; metrics in "
                      f"{run.out_dir / 'metrics.jsonl'}")
    return records


def main(config_path: str | None, overrides: list[str]) -> list[dict]:
    cfg = RunConfig.load(config_path, overrides)
    console = Console()
    records = run_with_display(cfg, console)
    if cfg.compare_sync and records and records[-1]["step"] == cfg.steps:
        sync_cfg = dataclasses.replace(cfg, out_dir=f"{cfg.out_dir}/sync", resume=False, compare_sync=False,
                                       rollout=dataclasses.replace(cfg.rollout, max_staleness=0))
        sync = run_with_display(sync_cfg, console)
        if sync:
            a, s = records[-1], sync[-1]
            console.print(f"async (max_staleness={cfg.rollout.max_staleness}) vs sync, same seed: "
                          f"{a['trained_tokens_per_s']:.0f} vs {s['trained_tokens_per_s']:.0f} trained tok/s = "
                          f"{a['trained_tokens_per_s'] / s['trained_tokens_per_s']:.2f}x; wall {a['wall_s']:.1f} s vs "
                          f"{s['wall_s']:.1f} s")
    return records
