"""Placement "ray": the trainer and the engine replicas as Ray actors in one placement group, the same loop inside.

    a placement group of trainer.num_ranks + num_engines bundles (one GPU each on CUDA, one logical CPU otherwise),
        PACKed: bundle 0 the trainer (`TrainerActor`, running `Run` as `tandem run` would; with trainer.num_ranks
        R > 1, FSDP2 over it and R - 1 `TrainerRank` actors in bundles 1 .. R - 1, `tandem.run.ray_trainer`),
        bundle R + i replica slot i
    replicas (`EngineActor`: an engine and its HTTP server on its node's address) started by `Replicas` through
        `ray_launcher`; a restarted replica goes to its slot's bundle again, so rank order is stable across restarts
    the weight group's store on the trainer's node address; the router in the trainer's process

Ray is optional (`pip install "tandem-rl[ray]"`) and imported by this module only. Without `TANDEM_RAY_ADDRESS` the
driver starts a local Ray instance of its own with logical resources only (`address="local"`: it never attaches to
a cluster that happens to run on the machine); with it (`auto`, or `ray://head:10001`) it joins that cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import Callable

import ray
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.config import RunConfig
from tandem.engine.client import EngineUnreachable
from tandem.run.replicas import Launcher, Replicas

ADDRESS_ENV = "TANDEM_RAY_ADDRESS"
STOP_S = 20.0  # how long a stopped run may take to save its checkpoint (and then to stop its replicas)


def init_ray(num_bundles: int, cuda: bool) -> None:
    """Join the cluster `TANDEM_RAY_ADDRESS` names, else start a local instance sized for `num_bundles`."""
    if ray.is_initialized():
        return
    address = os.environ.get(ADDRESS_ENV)
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        import torch

        ray.init(address="local", num_cpus=num_bundles, num_gpus=torch.cuda.device_count() if cuda else 0,
                 include_dashboard=False, log_to_driver=True)


def bundles(cfg: RunConfig) -> list[dict]:
    """The trainer's ranks (`trainer.num_ranks`), then the replicas: one device each."""
    cuda = cfg.engine.device.startswith("cuda")
    return [{"CPU": 1, "GPU": 1} if cuda else {"CPU": 1}
            for _ in range(cfg.trainer.num_ranks + cfg.rollout.num_engines)]


def _in_bundle(pg, index: int, cfg: RunConfig) -> dict:
    cuda = cfg.engine.device.startswith("cuda")
    return dict(num_cpus=1, num_gpus=1 if cuda else 0, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index))


@ray.remote
class EngineActor:
    """One replica: an engine and its HTTP server on this node's address, on the one GPU Ray gives the actor."""

    def __init__(self, model: str, config, seed: int, dtype: str):
        from tandem.engine.engine import Engine
        from tandem.server.http import ServerThread

        if config.device.startswith("cuda"):
            config = dataclasses.replace(config, device="cuda:0")  # (Ray sets CUDA_VISIBLE_DEVICES to its GPU)
        self.engine = Engine(model, config, dtype=dtype, seed=seed)
        self.server = ServerThread(self.engine, host=ray.util.get_node_ip_address(), port=0).start()

    def address(self) -> tuple[str, int]:
        return self.server.url, os.getpid()

    def ping(self) -> bool:
        return self.engine.is_alive()

    def stop(self) -> None:
        self.server.stop()
        self.engine.shutdown()


class RayReplica:
    """`Replicas`' handle of an `EngineActor`. `check` never blocks: it looks at a ping sent at the last look."""

    def __init__(self, actor, slot: int, timeout_s: float):
        self.actor, self.slot = actor, slot
        try:
            self.url, self.pid = ray.get(actor.address.remote(), timeout=timeout_s)
        except Exception as e:
            ray.kill(actor, no_restart=True)
            raise EngineUnreachable(f"engine actor of replica {slot}: not serving within {timeout_s:g} s: {e}") from e
        self._ping = actor.ping.remote()

    def __str__(self) -> str:
        return f"engine actor pid {self.pid} at {self.url}"

    def check(self) -> None:
        ready, _ = ray.wait([self._ping], timeout=0)
        if not ready:
            return
        try:
            alive = ray.get(ready[0])
        except ray.exceptions.RayActorError as e:
            raise EngineUnreachable(f"{self}: the actor died: {type(e).__name__}") from e
        if not alive:
            raise EngineUnreachable(f"{self}: its engine thread stopped")
        self._ping = self.actor.ping.remote()

    def stop(self, grace_s: float = 30.0) -> None:
        with contextlib.suppress(Exception):
            ray.get(self.actor.stop.remote(), timeout=grace_s)
        self.kill()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)


def ray_launcher(cfg: RunConfig, pg) -> Launcher:
    def launch(slot: int) -> RayReplica:
        actor = EngineActor.options(**_in_bundle(pg, cfg.trainer.num_ranks + slot, cfg)).remote(
            cfg.model, cfg.engine, cfg.seed, cfg.engine_dtype)
        return RayReplica(actor, slot, cfg.engine_start_timeout_s)

    return launch


def ray_replicas(cfg: RunConfig) -> Replicas:
    """The replicas of a trainer running in a `TrainerActor` (its placement group's bundles 1..N)."""
    pg = get_current_placement_group()
    if pg is None:
        raise ValueError("placement: ray runs the trainer in a Ray actor (`tandem run placement=ray`, or "
                         "`RayRun`); this process is none")
    replicas = Replicas(cfg, ray_launcher(cfg, pg), label=f"trainer actor pid {os.getpid()}")
    replicas.host = ray.util.get_node_ip_address()
    return replicas


@ray.remote
class TrainerActor:
    """The trainer in bundle 0: builds the `Run` (whose placement starts the replicas in the other bundles) and runs
    it; the driver reads its records as they come."""

    def __init__(self, cfg: RunConfig, prepare: Callable | None = None):
        from tandem.run.loop import Run
        from tandem.run.ray_trainer import FollowedTrainer, start_followers

        cuda = cfg.engine.device.startswith("cuda")
        if cuda:
            cfg = dataclasses.replace(cfg, trainer_device="cuda:0")
        followers = []
        if cfg.trainer.num_ranks > 1:  # FSDP2 over this actor (rank 0) and the others
            followers, joined = start_followers(get_current_placement_group(), cfg.trainer.num_ranks, cfg, cuda,
                                                cfg.engine_start_timeout_s)
        self.run = Run(cfg)
        if followers:
            ray.get(joined, timeout=cfg.engine_start_timeout_s)
            self.run.trainer = FollowedTrainer(self.run.trainer, followers)
        self.records: list[dict] = []
        self.trained: list[tuple[int, list]] = []
        self.run.on_batch = lambda version, batch: self.trained.append((version, batch))
        if prepare is not None:
            prepare(self.run)

    def train(self) -> list[dict]:
        async def train():
            self._task = asyncio.current_task()
            return await self.run.train(self.records.append)

        self._loop = asyncio.new_event_loop()
        try:
            return self._loop.run_until_complete(train())
        finally:
            self._loop.close()

    def stop(self) -> None:
        """Stop the run as Ctrl-C stops `tandem run`: it saves its checkpoint, then `train` raises."""
        if getattr(self, "_task", None) is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)

    def close(self) -> None:
        self.run.shutdown()

    def records_since(self, start: int) -> list[dict]:
        return self.records[start:]

    def inspect(self, probe: Callable):
        """`probe(run, trained)` evaluated here (tests: what the run did, as plain data)."""
        return probe(self.run, self.trained)


class RayRun:
    """`Run`'s face for `tandem run placement=ray`: `train(on_step)` runs the trainer actor to the end, passing
    each step's record on as it comes. `prepare(run)` runs in the actor before training (fault injection in tests)."""

    def __init__(self, cfg: RunConfig, prepare: Callable | None = None):
        from pathlib import Path

        self.cfg, self.out_dir = cfg, Path(cfg.out_dir)
        layout = bundles(cfg)
        init_ray(len(layout), cfg.engine.device.startswith("cuda"))
        self.pg = placement_group(layout, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=cfg.engine_start_timeout_s)
            # two threads: `records_since` answers while `train` runs
            options = {**_in_bundle(self.pg, 0, cfg), "max_concurrency": 2}
            self.actor = TrainerActor.options(**options).remote(cfg, prepare)
        except BaseException:
            remove_placement_group(self.pg)
            raise

    async def train(self, on_step: Callable[[dict], None] | None = None) -> list[dict]:
        """Cancelled (Ctrl-C), it stops the trainer's run, which saves its checkpoint, before it returns."""
        done, seen = self.actor.train.remote(), 0
        try:
            while True:
                finished, _ = await asyncio.to_thread(ray.wait, [done], timeout=0.25)
                records = await asyncio.to_thread(ray.get, self.actor.records_since.remote(seen))
                for record in records:
                    if on_step is not None:
                        on_step(record)
                seen += len(records)
                if finished:
                    return await asyncio.to_thread(ray.get, done)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                ray.get(self.actor.stop.remote(), timeout=STOP_S)
                ray.wait([done], timeout=STOP_S)
            raise

    def inspect(self, probe: Callable):
        return ray.get(self.actor.inspect.remote(probe))

    def shutdown(self) -> None:
        """Stop the replicas and the trainer, and free their bundles."""
        with contextlib.suppress(Exception):
            ray.get(self.actor.close.remote(), timeout=2 * STOP_S)
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(self.pg)
