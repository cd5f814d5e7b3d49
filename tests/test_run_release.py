"""A run that ends releases its engine and the trainer's weights as soon as it is dropped, without waiting for the
garbage collector: benchmarks run several runs in one process, and a run kept alive by a reference cycle until the
collector's next full pass (which may come many runs later) holds its engine's KV pool, so that the next engine sizes
its pool from what is left, or runs out of memory (seen on one GPU: colocated, then shared)."""

import gc
import weakref

import pytest

from tandem.config import RunConfig
from tandem.run.loop import run_recording


@pytest.mark.parametrize("overrides", [[], ["trainer.param_dtype=bfloat16"]], ids=["fp32", "bf16 copy"])
def test_a_finished_colocated_run_frees_its_engine_and_weights_once_dropped(tmp_path, overrides):
    cfg = RunConfig.load(None, ["steps=2", f"out_dir={tmp_path}", "rollout.group_size=2", "rollout.batch_groups=2",
                                *overrides])
    run, _, _ = run_recording(cfg)
    core = run.placement.engine.core
    refs = {"run": weakref.ref(run), "engine": weakref.ref(run.placement.engine), "core": weakref.ref(core),
            "KV pool": weakref.ref(core.pool.k_cache), "trainer": weakref.ref(run.trainer),
            "a weight the engine read": weakref.ref(next(run.trainer.model.parameters())),
            "the last push": weakref.ref(run._last_push.pending)}
    del core
    gc.disable()  # (what a collection would free is what this test is about)
    try:
        del run
        alive = [name for name, ref in refs.items() if ref() is not None]
    finally:
        gc.enable()
    assert not alive, f"kept alive by a reference cycle: {alive}"
