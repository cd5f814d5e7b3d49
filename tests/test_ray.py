"""Placement "ray" on a local CPU Ray instance (logical CPUs only, never an outside cluster): the trainer and two
engine replicas as actors in one placement group pass the replica test of the process placement: one replica's
process SIGKILLed mid-run, restarted in its bundle, rejoining with the current weights, no group lost or trained
twice (`test_scale_out.check_outcome`)."""

import asyncio

import pytest

ray = pytest.importorskip("ray")

import test_scale_out  # noqa: E402
from ray import cloudpickle  # noqa: E402
from test_scale_out import REPLICAS, check_outcome, outcome, prepare_kill  # noqa: E402

from tandem.config import RunConfig  # noqa: E402
from tandem.run.ray_placement import RayRun  # noqa: E402

cloudpickle.register_pickle_by_value(test_scale_out)  # its functions run in the trainer's actor


@pytest.mark.timeout(600)
def test_placement_ray_passes_the_replica_test_on_a_local_cpu_cluster(tmp_path):
    overrides = [o for o in REPLICAS if not o.startswith("placement=")]
    cfg = RunConfig.load(None, [*overrides, "placement=ray", f"out_dir={tmp_path}", "steps=5"])
    try:
        run = RayRun(cfg, prepare=prepare_kill)
        try:
            asyncio.run(run.train())
            o = run.inspect(outcome)
        finally:
            run.shutdown()
    finally:
        ray.shutdown()
    assert "the actor died" in o["lost"][0], o["lost"]
    check_outcome(o, steps=5)
