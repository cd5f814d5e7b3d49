"""Weights & Biases logging of a run's step records (`run.wandb`), beside TensorBoard's (`run.tensorboard`): the
same numbers, each record's numeric fields at its step. wandb is an optional dependency (`tandem-rl[wandb]`); its own
settings apply (`WANDB_MODE=offline` logs to `out_dir/wandb` without the network, `wandb sync` uploads later)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tandem.config import RunConfig


class WandbLog:
    """One W&B run for one tandem run: `log` each step's record, `close` at the end."""

    def __init__(self, cfg: RunConfig):
        try:
            import wandb
        except ImportError:
            raise ValueError("run.wandb: needs the wandb package (pip install 'tandem-rl[wandb]')") from None
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)  # (wandb writes its files under it)
        self.run = wandb.init(project=cfg.wandb_project, dir=cfg.out_dir, config=dataclasses.asdict(cfg))

    def log(self, record: dict) -> None:
        """The record's numbers (lists, dicts, strings and nulls left out), at its step."""
        self.run.log({key: value for key, value in record.items()
                      if isinstance(value, int | float) and not isinstance(value, bool)}, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def open_wandb(cfg: RunConfig) -> WandbLog | None:
    """A `WandbLog` when `cfg.wandb`, else None; ValueError naming the option when wandb is not installed."""
    return WandbLog(cfg) if cfg.wandb else None
