"""The trainer data parallel under Ray: `world` `TrainerRank` actors, one per bundle of a placement group, in one
torch.distributed group (gloo on CPUs, NCCL on GPUs) with the model sharded over them by FSDP2 (`trainer.fsdp`,
`tandem.trainer.parallel`): every rank gets the whole batch and trains on its share of the episodes.

`RayTrainers` drives them as one trainer: `step(groups)` runs the step on every rank at once and returns rank 0's
metrics; `named_weights()` gathers the full tensors (a collective: every rank takes part) and returns rank 0's.
In a run (`placement=ray`, `trainer.num_ranks`) rank 0 is the trainer's own actor (`TrainerActor`), which runs
`Run` with its trainer wrapped as `FollowedTrainer`: each collective call (a step, gathering the weights, the state
for a checkpoint) starts on the other ranks first, then runs on rank 0. Rank order is the bundles' order. Ray is
imported here only (`pip install "tandem-rl[ray]"`).
"""

from __future__ import annotations

import dataclasses
import datetime

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.config import LossConfig, TrainerConfig


@ray.remote
class TrainerRank:
    """One rank: joins the group, then builds the sharded trainer (the same seed on every rank: the same weights)."""

    def address(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0: hosts the group's store on this node from here on; its address and port."""
        from tandem.transport.dist import rendezvous

        self.store = rendezvous(ray.util.get_node_ip_address(), timeout_s)
        return self.store.host, self.store.port

    def setup(self, rank: int, world: int, master: tuple[str, int], model: str, cfg: TrainerConfig,
              loss: LossConfig, temperature: float, seed: int, cuda: bool, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        from tandem.model.loader import build_model
        from tandem.trainer.trainer import Trainer

        timeout = datetime.timedelta(seconds=timeout_s)
        store = self.store if rank == 0 else dist.TCPStore(*master, None, False, timeout)  # (both ends: a store)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        if not cuda:
            torch.set_num_threads(1)
        torch.manual_seed(seed)
        policy = build_model(model, device="cuda:0" if cuda else "cpu", dtype="float32", seed=seed)
        self.trainer = Trainer(policy, dataclasses.replace(cfg, fsdp=True), loss, temperature)

    def step(self, groups) -> dict:
        return self.trainer.step(groups)

    def weights(self) -> dict:
        return {name: t.cpu().clone() for name, t in self.trainer.named_weights()}

    def take_part(self, call: str, *args) -> None:
        """Rank 0's collective `call` ("named_weights", "state_dict", "load_state_dict"), this rank's part."""
        if call == "named_weights":
            for _ in self.trainer.named_weights():
                pass
        else:
            getattr(self.trainer, call)(*args)

    def version(self) -> int:
        return self.trainer.version


def start_followers(pg, world: int, cfg, cuda: bool, timeout_s: float) -> list:
    """Ranks 1 .. world - 1 in bundles 1 .. world - 1 of `pg`, joining the group this process (rank 0, in bundle 0)
    hosts; returns them once this process has joined too (it must build its trainer the same way: `setup`'s)."""
    import torch.distributed as dist

    from tandem.transport.dist import rendezvous

    followers = [TrainerRank.options(num_cpus=1, num_gpus=1 if cuda else 0, max_restarts=0,
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(
                                         pg, placement_group_bundle_index=r)).remote() for r in range(1, world)]
    store = rendezvous(ray.util.get_node_ip_address(), timeout_s)
    master = store.host, store.port
    refs = [a.setup.remote(r, world, master, cfg.model, cfg.trainer, cfg.loss, cfg.rollout.temperature, cfg.seed,
                           cuda, timeout_s) for r, a in enumerate(followers, 1)]
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return followers, refs


class FollowedTrainer:
    """Rank 0's `Trainer` with its followers: every call that is a collective under FSDP runs on all ranks."""

    def __init__(self, trainer, followers: list):
        self.trainer, self.followers = trainer, followers

    def __getattr__(self, name):
        return getattr(self.trainer, name)

    def _all(self, call: str, *args):
        refs = [f.take_part.remote(call, *args) for f in self.followers]
        try:
            return getattr(self.trainer, call)(*args)
        finally:
            ray.get(refs)

    def step(self, groups) -> dict:
        refs = [f.step.remote(groups) for f in self.followers]
        try:
            return self.trainer.step(groups)
        finally:
            ray.get(refs)

    def named_weights(self):
        refs = [f.take_part.remote("named_weights") for f in self.followers]
        try:
            yield from self.trainer.named_weights()
        finally:
            ray.get(refs)

    def state_dict(self) -> dict:
        return self._all("state_dict")

    def load_state_dict(self, state: dict) -> None:
        self._all("load_state_dict", state)


class RayTrainers:
    """`world` ranks in bundles `first_bundle` .. `first_bundle + world - 1` of `pg` (one CPU, or one GPU, each)."""

    def __init__(self, pg, world: int, model: str, cfg: TrainerConfig, loss: LossConfig, temperature: float = 1.0,
                 seed: int = 0, cuda: bool = False, first_bundle: int = 0, timeout_s: float = 300.0):
        self.ranks = [TrainerRank.options(num_cpus=1, num_gpus=1 if cuda else 0, max_restarts=0,
                                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                                              pg, placement_group_bundle_index=first_bundle + r)).remote()
                      for r in range(world)]
        master = ray.get(self.ranks[0].address.remote(timeout_s), timeout=timeout_s)
        ray.get([a.setup.remote(r, world, master, model, cfg, loss, temperature, seed, cuda, timeout_s)
                 for r, a in enumerate(self.ranks)], timeout=timeout_s)

    def step(self, groups) -> dict:
        return ray.get([a.step.remote(groups) for a in self.ranks])[0]

    def named_weights(self) -> list:
        return list(ray.get([a.weights.remote() for a in self.ranks])[0].items())

    def shutdown(self) -> None:
        for a in self.ranks:
            ray.kill(a, no_restart=True)
