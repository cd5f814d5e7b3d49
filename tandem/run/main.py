"""`tandem run`: the RL loop with a live display, metrics as JSON lines, a checkpoint on exit."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal

from rich.console import Console
from rich.live import Live
from rich.table import Table

from tandem.config import RunConfig
from tandem.rollout.registry import resolve_task
from tandem.run.loop import Run
from tandem.run.wandb_log import open_wandb


@dataclasses.dataclass(frozen=True, slots=True)
class Column:
    key: str  # in the step's record
    header: str
    fmt: str
    rank: int  # 1: always shown; on a narrow console the highest ranks go first
    scale: float = 1.0


COLUMNS = [Column("step", "step", "{:.0f}", 1), Column("version", "version", "{:.0f}", 3),
           Column("in_flight_episodes", "in flight", "{:.0f}", 3), Column("buffered_groups", "buffer", "{:.0f}", 4),
           Column("reward_mean", "reward", "{:+.3f}", 1), Column("staleness_mean", "stale", "{:.2f}", 2),
           Column("staleness_max", "max stale", "{:.0f}", 4),
           Column("trained_tokens_per_s", "train tok/s", "{:.0f}", 2),
           Column("rollout_tokens_per_s", "gen tok/s", "{:.0f}", 2), Column("cache_hit_rate", "cache hit", "{:.0%}", 4),
           Column("cache_reuse_vs_ideal", "reuse/ideal", "{:.0%}", 5), Column("mismatch_kl", "mism. KL", "{:+.1e}", 4),
           Column("clip_frac", "clip", "{:.2f}", 5), Column("load_balancing_loss", "lb loss", "{:.3f}", 5),
           Column("transfer_s", "sync ms", "{:.1f}", 3, 1e3),
           Column("pause_s", "pause ms", "{:.1f}", 3, 1e3), Column("wait_s", "wait s", "{:.2f}", 5)]


class RunTable:
    """The last `last` steps as a table with as many columns as the console's width holds: the least important
    (highest rank, rightmost first) are dropped rather than squeezed. Rendered anew at each refresh, so it follows
    the records list and the terminal's width."""

    def __init__(self, records: list[dict], last: int = 12):
        self.records, self.last = records, last

    def __rich_console__(self, console, options):
        records = self.records[-self.last:]
        cells = {c.key: [_cell(r.get(c.key), c) for r in records] for c in COLUMNS}
        # a column takes its widest cell or header, one space each side and one border (and the table one more)
        width = {c.key: max([len(c.header), *map(len, cells[c.key])]) + 3 for c in COLUMNS}
        shown = list(COLUMNS)
        for column in sorted(reversed(COLUMNS), key=lambda c: -c.rank):
            if column.rank == 1 or 1 + sum(width[c.key] for c in shown) <= options.max_width:
                break
            shown.remove(column)
        table = Table(title="tandem run", expand=False)
        for c in shown:
            table.add_column(c.header, justify="right", no_wrap=True)
        for i in range(len(records)):
            table.add_row(*(cells[c.key][i] for c in shown))
        yield table


def _cell(value: float | None, column: Column) -> str:
    return "-" if value is None else column.fmt.format(value * column.scale)


def _tensorboard(cfg: RunConfig):
    if not cfg.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("run.tensorboard: needs the tensorboard package (pip install tensorboard)") from None
    return SummaryWriter(cfg.out_dir)


class Interrupted(Exception):
    """The run was stopped by SIGINT (Ctrl-C) or SIGTERM, after saving its checkpoint; `exit_code` is 128 + the
    signal's number, as a shell reports a process the signal ended."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.exit_code = 128 + signum


def run_with_display(cfg: RunConfig, console: Console) -> list[dict]:
    """One run with the live table. Ctrl-C or SIGTERM stops it cleanly (the loop saves a checkpoint), then raises
    `Interrupted`."""
    console.print(f"[bold]tandem run[/]: task={cfg.task} model={cfg.model} steps={cfg.steps} "
                  f"max_staleness={cfg.rollout.max_staleness} pause_mode={cfg.rollout.pause_mode} "
                  f"placement={cfg.placement} (trainer on {cfg.trainer_device or cfg.engine.device}, engine on "
                  f"{cfg.engine.device}) out_dir={cfg.out_dir}")
    resolve_task(cfg.task)  # a bad task is an error before the engine starts
    writer = _tensorboard(cfg)
    wandb_log = open_wandb(cfg)  # (before the engine starts: a missing package fails fast)
    if cfg.placement == "ray":
        from tandem.run.ray_placement import RayRun

        run = RayRun(cfg)
    else:
        run = Run(cfg)
    run.out_dir.mkdir(parents=True, exist_ok=True)
    (run.out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    records: list[dict] = []
    received: list[int] = []

    def stop(signum, frame):  # SIGTERM as Ctrl-C: the loop's cleanup runs and saves the checkpoint
        received.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    # (under Ray, asyncio's own Ctrl-C handling did not reach the run: Ctrl-C is made to stop it as SIGTERM does)
    previous_int = signal.signal(signal.SIGINT, stop) if cfg.placement == "ray" else None
    try:
        with Live(RunTable(records), console=console, refresh_per_second=4) as live:
            def on_step(record):
                records.append(record)
                live.refresh()
                for key, value in record.items():
                    if writer is not None and isinstance(value, int | float):
                        writer.add_scalar(key, value, record["step"])
                if wandb_log is not None:
                    wandb_log.log(record)

            asyncio.run(run.train(on_step))
    except KeyboardInterrupt:
        if not received:
            received.append(signal.SIGINT)
        console.print(f"\ninterrupted: checkpoint saved in {run.out_dir}")
    finally:
        signal.signal(signal.SIGTERM, previous)
        if previous_int is not None:
            signal.signal(signal.SIGINT, previous_int)
        run.shutdown()
        if writer is not None:
            writer.close()
        if wandb_log is not None:
            wandb_log.close()
    if records:
        first, last = records[0], records[-1]
        console.print(f"\ndone: {last['step']} steps in {last['wall_s']:.1f} s; reward {first['reward_mean']:+.3f} -> "
                      f"{last['reward_mean']:+.3f}; {last['trained_tokens_per_s']:.0f} trained tok/s; trainer idle "
                      f"{last['trainer_idle_frac']:.0%}, engine idle {last['engine_idle_frac']:.0%}, admission held by "
                      f"the staleness bound {min(1.0, last['bound_seconds'] / last['wall_s']):.0%}; weight sync "
                      f"{1e3 * last['transfer_s']:.1f} ms ({last['sync_gb_per_s']:.2f} GB/s), generation paused "
                      f"{1e3 * last['pause_s']:.1f} ms; dropped groups {last['dropped_groups']}; metrics in "
                      f"{run.out_dir / 'metrics.jsonl'}")
    if received:
        raise Interrupted(received[0])
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
