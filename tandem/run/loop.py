"""The RL loop: rollouts and training at the same time, weights flowing back after every step.

    place the engine (a thread here, or a process of its own) and push it the trainer's weights
    start the rollout manager (it keeps episodes in flight within the staleness bound)
    for each step:
        batch   <- the next batch of completed groups (wait only if it is not complete yet)
        metrics <- train on it (in a worker thread: the event loop keeps driving rollouts)
        push the new weights (the engine receives them while generating, pauses only to load them),
        let the manager admit more

With `max_staleness = 0` the manager admits the next batch's groups only after the new weights are in,
which is synchronous RL (generate, train, sync, repeat) with the same code. The manager drives the engine
through the same async API wherever it runs (see `tandem.run.placement`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.config import RunConfig
from tandem.engine.client import EngineUnreachable
from tandem.model.loader import build_model
from tandem.rollout.manager import RolloutManager
from tandem.rollout.registry import make_env_factory
from tandem.run import checkpoint
from tandem.run.export import export_trainer
from tandem.run.heap import freeze_heap
from tandem.run.loop_lag import LoopLag
from tandem.run.pending import PendingSync
from tandem.run.placement import place
from tandem.trainer.trainer import Trainer
from tandem.transport.switch import switching
from tandem.types import Group

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
REPLICA_RETRY_DELAY_S = 0.5  # before a group cut short by a lost replica runs again (doubled each time)


class Run:
    """One RL run: the rollout manager and the trainer in this process, the engine where `cfg.placement` puts it,
    and the weight sync between them."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        if cfg.resume and not (Path(cfg.out_dir) / CHECKPOINT).is_file():
            raise ValueError(f"resume: no {CHECKPOINT} in {cfg.out_dir} to resume from (without resume=true the run "
                             "starts afresh)")
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.placement = place(cfg)
        self.engine = self.placement.engine
        try:
            policy = build_model(cfg.model, device=cfg.trainer_device or cfg.engine.device, dtype="float32",
                                 seed=cfg.seed)
            self.trainer = Trainer(policy, cfg.trainer, cfg.loss, cfg.rollout.temperature)
            env_factory = make_env_factory(cfg, self.engine.model_config.vocab_size)
        except BaseException:
            self.placement.shutdown()
            raise
        max_context = min(cfg.random_agent.max_context, self.engine.max_context_len)
        engine = self.engine  # (the lambda below holds the engine, not the run: no cycle keeps a run's engine alive)
        # the episodes keep their routing whenever the engine does (always under trainer.routing_replay)
        # with replicas, a group an unreachable replica cut short runs again on another one at once
        self.manager = RolloutManager(self.engine, env_factory, cfg.rollout, max_context, cfg.seed,
                                      version=lambda: engine.weight_version,
                                      routing=cfg.engine.enable_return_routed_experts,
                                      **({"retry_delay_s": REPLICA_RETRY_DELAY_S} if cfg.replicas else {}))
        self.out_dir = Path(cfg.out_dir)
        self.history: list[dict] = []
        self._training: tuple[asyncio.Future, list[Group]] | None = None  # a trainer step in its thread, its batch
        self.on_batch: Callable[[int, list[Group]], None] | None = None  # sees each batch and its version
        self._weights_lock: asyncio.Lock | None = None  # held while a trainer step changes the weights
        self._last_push = LastPush()  # the trainer's hook fences it (it holds no reference to the run: no cycle)
        self._writing: asyncio.Future | None = None  # a step's checkpoint being written (`_checkpoint_beside`)
        self.loop_lag = LoopLag()  # the event loop's holds, watched while `train` runs
        self.trainer.before_weight_write = self._last_push.fence

    @contextlib.asynccontextmanager
    async def _current_weights(self):
        """The trainer's weights and version, unchanged while held (a replica rejoining gets them)."""
        async with self._weights_lock:
            yield self.trainer.named_weights(), self.trainer.version

    async def train(self, on_step: Callable[[dict], None] | None = None) -> list[dict]:
        """Run until `cfg.steps` optimizer steps are done. Saves a checkpoint at the end and when cancelled
        (Ctrl-C) or failing once running. Raises when the engine is gone (the placement's monitor) or a whole batch
        failed. Returns the per-step records (also appended to `out_dir/metrics.jsonl`)."""
        cfg = self.cfg
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if cfg.resume:
            self._load_checkpoint()
        self._keep_records_upto(self.trainer.version if cfg.resume else 0)  # one record per step, none twice
        # the engine must hold the trainer's weights and version before anything is admitted
        try:
            await self.placement.start(self.trainer.named_weights(), self.trainer.version)
        except BaseException:
            await self.placement.disconnect()  # the client's connections belong to this event loop
            raise
        start = time.perf_counter()
        idle0 = (await self.engine.get_stats()).idle_seconds
        runner = asyncio.create_task(self.manager.run())
        self.loop_lag.start()
        self._weights_lock = asyncio.Lock()
        monitor = asyncio.create_task(self.placement.monitor(self._current_weights))
        waited = trained = 0.0
        first_step = True
        finishing: asyncio.Task | None = None  # the last step's end: once the engine applied its weights
        try:
            while self.trainer.version < cfg.steps:
                if asyncio.current_task().cancelling():  # (a cancel some await swallowed: Ctrl-C still stops)
                    raise asyncio.CancelledError
                t0 = time.perf_counter()
                batch = await _unless_failed(self.manager.next_batch(), monitor, lambda _: self.manager.untake(),
                                             finishing)
                if finishing is not None:  # (done by now, normally: its record first, or its load's error)
                    await finishing
                    finishing = None
                if not batch:
                    self.placement.check()  # the likeliest reason, named if so
                    raise RuntimeError(f"every group of batch {self.trainer.version} failed; dropped so far: "
                                       f"{dict(self.manager.dropped)}")
                if self.on_batch is not None:
                    self.on_batch(self.trainer.version, batch)
                t1 = time.perf_counter()
                # the step's thread runs on if the run is stopped meanwhile: `_settle_step` waits for it
                async with self._weights_lock:
                    self._training = asyncio.get_running_loop().run_in_executor(None, self.trainer.step, batch), batch
                    metrics = await asyncio.shield(self._training[0])
                    self._training = None
                if first_step:  # what the first step built (a compiled step's caches) lives as long as the run: it
                    freeze_heap()  # is left out of the collector's full passes, which hold the agents and the engine
                    first_step = False
                metrics["group_ids"] = [g.index for g in batch]  # what this step trained (a soak checks it)
                t2 = time.perf_counter()
                try:  # returns once the engine holds the weights, or (one GPU) once their load is queued to it
                    pending = await self.placement.send(self.trainer.named_weights(), self.trainer.version)
                    self._last_push.pending = pending
                except BaseException as e:  # the step was trained (a resume pushes its weights): record it
                    self._append_record(dict(step=self.trainer.version, **metrics, error=repr(e)))
                    if isinstance(e, EngineUnreachable):
                        self.placement.check()  # an engine process that died is named, with its exit code
                    raise
                waited, trained = waited + t1 - t0, trained + t2 - t1
                finishing = asyncio.create_task(self._finish_step(pending, metrics, t1 - t0, t2 - t1, waited,
                                                                  start, idle0, on_step))
            if finishing is not None:
                await finishing
                finishing = None
        finally:
            self.loop_lag.stop()
            runner.cancel()
            monitor.cancel()  # (first: nothing may read the weights while a step's thread still runs)
            if finishing is not None:
                finishing.cancel()
            await asyncio.gather(runner, monitor, *[finishing] if finishing else [], return_exceptions=True)
            if self._training is not None:
                await self._settle_step(*self._training)
            await self.manager.stop()
            await self.placement.disconnect()
            if self._writing is not None:  # (one writer of the file at a time: a step's may still write)
                await asyncio.gather(self._writing, return_exceptions=True)
                self._writing = None
            # the run's end, as a step's: copied and written by threads, the engine's own thread going on meanwhile
            await self._checkpoint_beside()
            await self._writing
        if cfg.trainer.export_every and self.trainer.version % cfg.trainer.export_every:  # (else written above)
            export_trainer(cfg, self.trainer)
        return self.history

    async def _finish_step(self, pending: PendingSync, metrics: dict, wait_s: float, train_s: float, waited: float,
                           start: float, idle0: float, on_step: Callable[[dict], None] | None) -> None:
        """A step's end, while the run goes on to the next batch: once the engine applied its weights, tell the
        manager (the staleness bound counts a version from then on), record the step, checkpoint and export."""
        cfg = self.cfg
        try:
            with switching():  # this thread wakes when the engine set the load's result: take the GIL soon
                sync = await pending.applied()
            self.manager.notify_version()
            stats = await self.engine.get_stats()
        except BaseException as e:  # the step was trained (a resume pushes its weights): record it
            self._append_record(dict(step=pending.version, **metrics, error=repr(e)))
            if isinstance(e, EngineUnreachable):
                self.placement.check()  # an engine process that died is named, with its exit code
            raise
        wall = time.perf_counter() - start
        record = dict(
            step=pending.version, version=stats.weight_version, wall_s=wall, time=time.time(),
            **metrics, **self.manager.summary(),
            wait_s=wait_s, train_s=train_s, transfer_s=sync.transfer_s, transfer_wait_s=sync.wait_s,
            pause_s=sync.pause_s, sync_s=sync.sync_s, applied_s=sync.applied_s, sync_bytes=sync.num_bytes,
            sync_gb_per_s=sync.gb_per_s,
            trainer_idle_frac=waited / wall,
            engine_idle_frac=(stats.idle_seconds - idle0) / wall / self.placement.num_engines,
            trained_tokens_per_s=(sum(r["tokens_trained"] for r in self.history)
                                  + metrics["tokens_trained"]) / wall,
            generated_tokens=stats.generated_tokens, prefill_tokens_computed=stats.prefill_tokens_computed,
            engine_steps=stats.num_steps, engine_decode_steps=stats.decode_steps,
            engine_running_request_steps=stats.running_request_steps,
            engine_waiting_request_steps=stats.waiting_request_steps, engine_busy_s=stats.busy_seconds,
            engine_idle_s=stats.idle_seconds,
            engine_command_waits=stats.command_waits, engine_slow_iterations=stats.slow_iterations,
            engine_slowest_iteration_s=stats.slowest_iteration_seconds,
            engine_forward_s=stats.forward_seconds, engine_schedule_s=stats.schedule_seconds,
            engine_prepare_s=stats.prepare_seconds, engine_postprocess_s=stats.postprocess_seconds,
            rollout_tokens_per_s=stats.generated_tokens / wall,
            cache_hit_rate=stats.cache_hit_rate,
            cache_reuse_vs_ideal=stats.reuse_vs_ideal if stats.ideal_measured else None,
            dropped=dict(self.manager.dropped),
            # the event loop held past `loop_lag.HELD_S` so far (every episode waited): how often, the longest
            loop_holds=len(self.loop_lag.holds), loop_longest_hold_s=self.loop_lag.longest_s,
            **self.placement.view(),
        )
        self._append_record(record)
        if on_step:
            on_step(record)
        if cfg.checkpoint_every and pending.version % cfg.checkpoint_every == 0:
            await self._checkpoint_beside()
        if cfg.trainer.export_every and pending.version % cfg.trainer.export_every == 0:
            await asyncio.to_thread(export_trainer, cfg, self.trainer)  # (rollouts go on meanwhile)

    async def _settle_step(self, step: asyncio.Future, batch: list[Group]) -> None:
        """The run stops (cancelled, or failing) while a trainer step runs: wait for its thread, so that nothing is
        saved while it trains. A step that finished is recorded; the batch of one that failed goes back to the
        manager, to be trained after a resume."""
        self._training = None
        try:
            metrics = await step
        except Exception:
            self.manager.untake()
            return
        self._append_record(dict(step=self.trainer.version, **metrics, group_ids=[g.index for g in batch],
                                 interrupted=True))

    def _append_record(self, record: dict) -> None:
        self.history.append(record)
        with open(self.out_dir / METRICS, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _keep_records_upto(self, step: int) -> None:
        """Drop the records of steps after `step` (trained after the checkpoint a crash went back to; they are
        trained again), so that the file holds each step once."""
        path = self.out_dir / METRICS
        if not path.is_file():
            return
        kept = [line for line in path.read_text().splitlines(keepends=True)
                if line.strip() and json.loads(line)["step"] <= step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)

    async def _checkpoint_beside(self) -> None:
        """A checkpoint of now, written by a thread: the agents' turns go on meanwhile. Where host memory holds a
        copy of the state (`tandem.run.checkpoint`), a thread copies it first and the run goes on once it has (the
        next step, which awaits this step's end, waits for the copy only); else the live tensors are written and the
        next step waits for the write. The write before is awaited first (one writer of the file at a time; its
        error raised here)."""
        if self._writing is not None:
            await asyncio.shield(self._writing)
        state = self._checkpoint_state()
        copy = checkpoint.fits_in_host_memory(state)
        if copy:
            state = await asyncio.to_thread(checkpoint.copied, state)
        self._writing = asyncio.ensure_future(asyncio.to_thread(self._write_checkpoint, state))
        self._writing.add_done_callback(_log_failed_write)
        if not copy:
            await asyncio.shield(self._writing)

    def _checkpoint_state(self) -> dict:
        """What a checkpoint holds, taken on the event loop's thread (the manager's state is a copy; the trainer's
        tensors are the live ones: write them before its next step)."""
        return {"trainer": self.trainer.state_dict(), "manager": self.manager.state_dict(self.trainer.version),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}

    def _write_checkpoint(self, state: dict) -> None:
        tmp = self.out_dir / (CHECKPOINT + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.out_dir / CHECKPOINT)  # atomic: a crash mid-save keeps the previous checkpoint

    def _load_checkpoint(self) -> None:
        state = torch.load(self.out_dir / CHECKPOINT, weights_only=True)  # tensors and plain data: no code runs
        self.trainer.load_state_dict(state["trainer"])
        self.manager.load_state_dict(state["manager"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        log.info("resumed at version %d with %d buffered groups, %d to re-run", self.trainer.version,
                 len(self.manager.buffer), len(self.manager._readmit))

    def shutdown(self) -> None:
        self.placement.shutdown()
        gc.unfreeze()  # (what the first step froze goes before the interpreter does: no leak report at its exit)


class LastPush:
    """The run's last push (`pending`), which the trainer fences before it writes its weights (`fence`, in the
    step's thread: the engine's reads of it come first; raises that load's error)."""

    def __init__(self):
        self.pending: PendingSync | None = None

    def fence(self) -> None:
        if (pending := self.pending) is not None:
            pending.fence()


def _log_failed_write(writing: asyncio.Future) -> None:
    if not writing.cancelled() and writing.exception() is not None:
        log.error("checkpoint: writing %s failed (the one before stays): %r", CHECKPOINT, writing.exception())


async def _unless_failed(coro, monitor: asyncio.Task, abandoned: Callable[[object], None],
                         also: asyncio.Task | None = None):
    """Await `coro`, unless `monitor` (which only ever ends by raising) ends first, or `also` (a task that may
    end either way) fails first: then raise that error. If the caller is cancelled meanwhile, `coro` is cancelled
    too, or, if it had just finished, `abandoned` gets its result (nothing it took may be lost)."""
    task = asyncio.ensure_future(coro)
    watched = [monitor] + ([also] if also is not None and not also.done() else [])
    try:
        while not task.done() and not monitor.done():
            await asyncio.wait([task, *watched], return_when=asyncio.FIRST_COMPLETED)
            if also in watched and also.done():
                if also.cancelled() or also.exception() is not None:
                    break
                watched.remove(also)  # (it ended well: wait on for `coro`)
    except asyncio.CancelledError:
        if task.done() and not task.cancelled() and task.exception() is None:
            abandoned(task.result())
        raise
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        if monitor.done():
            monitor.result()
        also.result()  # (its error; `coro` was cancelled for it)
    return task.result()


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
