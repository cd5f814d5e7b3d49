"""The RL loop: rollouts and training at the same time, weights flowing back after every step.

    start the rollout manager (it keeps episodes in flight within the staleness bound)
    for each step:
        batch   <- the next batch of completed groups (wait only if it is not complete yet)
        metrics <- train on it (in a worker thread: the event loop keeps driving rollouts)
        push the new weights into the engine (pause, update, resume), let the manager admit more

With `max_staleness = 0` the manager admits the next batch's groups only after the new weights are in,
which is synchronous RL (generate, train, sync, repeat) with the same code.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.config import RunConfig
from tandem.engine.engine import Engine
from tandem.model.loader import build_model
from tandem.rollout.env import EnvFactory
from tandem.rollout.manager import RolloutManager
from tandem.rollout.random_agent import RandomAgentEnv
from tandem.rollout.tasks import GuessNumberEnv, TargetTokensEnv
from tandem.trainer.trainer import Trainer
from tandem.transport.weights import InProcessReceiver, InProcessSender
from tandem.types import Group

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"


def make_env_factory(cfg: RunConfig, vocab_size: int) -> EnvFactory:
    if cfg.task == "random":
        return lambda group_seed, j: RandomAgentEnv(cfg.random_agent, vocab_size, group_seed, j)
    if cfg.task == "target_tokens":
        return lambda group_seed, j: TargetTokensEnv(vocab_size, group_seed, j)
    return lambda group_seed, j: GuessNumberEnv(vocab_size, group_seed, j)


class Run:
    """One RL run: engine, trainer, rollout manager and the weight transport between them."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.engine = Engine(cfg.model, cfg.engine, seed=cfg.seed)
        policy = build_model(cfg.model, device=cfg.engine.device, dtype="float32", seed=cfg.seed)
        self.trainer = Trainer(policy, cfg.trainer, cfg.loss, cfg.rollout.temperature)
        max_context = min(cfg.random_agent.max_context, self.engine.max_context_len)
        self.manager = RolloutManager(self.engine, make_env_factory(cfg, self.engine.model_config.vocab_size),
                                      cfg.rollout, max_context, cfg.seed, version=lambda: self.engine.weight_version)
        self.receiver = InProcessReceiver()
        self.sender = InProcessSender(self.receiver)
        self.out_dir = Path(cfg.out_dir)
        self.history: list[dict] = []
        self.on_batch: Callable[[int, list[Group]], None] | None = None  # sees each batch and its version

    async def _push_weights(self) -> tuple[float, float]:
        """Send the trainer's weights through the transport; the engine side receives them while generating,
        then pauses (the configured mode) only to load them. Returns (transfer seconds, pause seconds)."""
        received = asyncio.create_task(asyncio.to_thread(self.receiver.receive))
        transfer = await asyncio.to_thread(self.sender.send, self.trainer.named_weights(),
                                           self.trainer.version)
        version, named = await received
        t0 = time.perf_counter()
        await self.engine.pause(self.cfg.rollout.pause_mode)
        try:
            await self.engine.update_weights(named.items(), version)
        finally:
            await self.engine.resume()
        return transfer.seconds, time.perf_counter() - t0

    async def train(self, on_step: Callable[[dict], None] | None = None) -> list[dict]:
        """Run until `cfg.steps` optimizer steps are done. Saves a checkpoint at the end and when cancelled
        (Ctrl-C). Returns the per-step records (also appended to `out_dir/metrics.jsonl`)."""
        cfg = self.cfg
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if cfg.resume and (self.out_dir / CHECKPOINT).is_file():
            await self._load_checkpoint()
        runner = asyncio.create_task(self.manager.run())
        start = time.perf_counter()
        busy0 = (await self.engine.get_stats()).busy_seconds
        waited = trained = 0.0
        try:
            while self.trainer.version < cfg.steps:
                t0 = time.perf_counter()
                batch = await self.manager.next_batch()
                if self.on_batch is not None:
                    self.on_batch(self.trainer.version, batch)
                t1 = time.perf_counter()
                metrics = await asyncio.to_thread(self.trainer.step, batch)
                t2 = time.perf_counter()
                transfer_s, pause_s = await self._push_weights()
                self.manager.notify_version()
                waited, trained = waited + t1 - t0, trained + t2 - t1
                stats = await self.engine.get_stats()
                wall = time.perf_counter() - start
                record = dict(
                    step=self.trainer.version, version=self.engine.weight_version, wall_s=wall,
                    **metrics, **self.manager.summary(),
                    wait_s=t1 - t0, train_s=t2 - t1, transfer_s=transfer_s, pause_s=pause_s,
                    trainer_idle_frac=waited / wall, engine_idle_frac=1 - (stats.busy_seconds - busy0) / wall,
                    trained_tokens_per_s=(sum(r["tokens_trained"] for r in self.history)
                                          + metrics["tokens_trained"]) / wall,
                    generated_tokens=stats.generated_tokens, rollout_tokens_per_s=stats.generated_tokens / wall,
                    cache_hit_rate=stats.cache_hit_rate,
                    dropped=dict(self.manager.dropped),
                )
                self.history.append(record)
                with open(self.out_dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")
                if on_step:
                    on_step(record)
                if cfg.checkpoint_every and self.trainer.version % cfg.checkpoint_every == 0:
                    self._save_checkpoint()
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            await self.manager.stop()
            self._save_checkpoint()
        return self.history

    def _save_checkpoint(self) -> None:
        state = {"trainer": self.trainer.state_dict(), "manager": self.manager.state_dict(),
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
        tmp = self.out_dir / (CHECKPOINT + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.out_dir / CHECKPOINT)  # atomic: a crash mid-save keeps the previous checkpoint

    async def _load_checkpoint(self) -> None:
        state = torch.load(self.out_dir / CHECKPOINT, weights_only=False)
        self.trainer.load_state_dict(state["trainer"])
        self.manager.load_state_dict(state["manager"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        # the engine must hold the trainer's weights and version before anything is admitted
        await self._push_weights()
        log.info("resumed at version %d with %d buffered groups, %d to re-run", self.trainer.version,
                 len(self.manager.buffer), len(self.manager._readmit))

    def shutdown(self) -> None:
        self.engine.shutdown()


def run_recording(cfg: RunConfig) -> tuple[Run, list[dict], list[tuple[int, list[Group]]]]:
    """Run to the end; returns the run, its per-step records and every batch with the version it was trained
    at (for tests and benchmarks)."""
    run = Run(cfg)
    trained: list[tuple[int, list[Group]]] = []
    run.on_batch = lambda version, batch: trained.append((version, batch))
    try:
        history = asyncio.run(run.train())
    finally:
        run.shutdown()
    return run, history, trained
