"""Placement "ray" on a local CPU Ray instance (logical CPUs only, never an outside cluster): the trainer and two
engine replicas as actors in one placement group pass the replica test of the process placement (one replica's
process SIGKILLed mid-run, restarted in its bundle, rejoining with the current weights, no group lost or trained
twice: `test_scale_out.check_outcome`); and FSDP2 over two trainer actors takes the step one process takes, and
trains a run whose replica ends up with the weights the ranks hold."""

import asyncio
import sys

import pytest

ray = pytest.importorskip("ray")

import test_scale_out  # noqa: E402
from ray import cloudpickle  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from test_scale_out import REPLICAS, check_outcome, outcome, prepare_kill  # noqa: E402
from test_trainer_parallel import MICRO, assert_weights_close, make_groups, make_trainer, weights  # noqa: E402

from tandem.config import LossConfig, RunConfig, TrainerConfig  # noqa: E402
from tandem.run.ray_placement import RayRun  # noqa: E402
from tandem.run.ray_trainer import RayTrainers  # noqa: E402
from tandem.transport.checksum import weights_checksum  # noqa: E402

cloudpickle.register_pickle_by_value(test_scale_out)  # its functions (and this module's) run in the trainer's actor
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=3, include_dashboard=False)  # a new instance, never one already running
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_placement_ray_passes_the_replica_test_on_a_local_cpu_cluster(tmp_path):
    overrides = [o for o in REPLICAS if not o.startswith("placement=")]
    cfg = RunConfig.load(None, [*overrides, "placement=ray", f"out_dir={tmp_path}", "steps=5"])
    run = RayRun(cfg, prepare=prepare_kill)
    try:
        asyncio.run(run.train())
        o = run.inspect(outcome)
    finally:
        run.shutdown()
    assert "the actor died" in o["lost"][0], o["lost"]
    check_outcome(o, steps=5)


def test_fsdp_over_two_trainer_actors_takes_the_single_process_step():
    groups = make_groups()
    single = make_trainer()
    expected = single.step(groups)
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    trainers = RayTrainers(pg, 2, "tiny", TrainerConfig(micro_batch_tokens=MICRO), LossConfig())
    try:
        got = trainers.step(groups)
        got_weights = dict(trainers.named_weights())
    finally:
        trainers.shutdown()
        remove_placement_group(pg)
    for key in expected.keys() - {"ess"}:  # (ess is averaged over micro-batches: it depends on the packing)
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert_weights_close(got_weights, weights(single), rtol=1e-5, atol=1e-6)


def ranks_and_replica(run, trained) -> dict:
    import torch.distributed as dist

    return dict(history=run.history, world=dist.get_world_size(), checksum=weights_checksum(
        run.trainer.named_weights()))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ray_run_trains_with_fsdp_over_two_trainer_actors(tmp_path):
    overrides = [o for o in REPLICAS if not o.startswith(("placement=", "rollout.num_engines", "rollout.restart"))]
    cfg = RunConfig.load(None, [*overrides, "placement=ray", "trainer.fsdp=true", "trainer.num_ranks=2",
                                f"out_dir={tmp_path}", "steps=3"])
    run = RayRun(cfg)
    try:
        asyncio.run(run.train())
        o = run.inspect(ranks_and_replica)
    finally:
        run.shutdown()
    assert [(h["step"], h["version"]) for h in o["history"]] == [(1, 1), (2, 2), (3, 3)]
    assert o["world"] == 2 and o["history"][-1]["replica_checksums"][0] == o["checksum"]
