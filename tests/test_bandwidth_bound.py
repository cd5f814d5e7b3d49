"""The engine-throughput benchmark's bandwidth bound (issue 27) against a hand computation, and its stand-in for
the projections' default tilings from a sweep's file."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tandem.config import PRESETS
from tandem.kernels.small_linear import Blocks, default_blocks

spec = importlib.util.spec_from_file_location(
    "engine_throughput", Path(__file__).parents[1] / "benchmarks" / "engine_throughput.py")
engine_throughput = importlib.util.module_from_spec(spec)
spec.loader.exec_module(engine_throughput)


def test_bound_reads_the_weights_and_the_running_kv_each_step():
    # step 0: both sequences run, contexts 2 and 3: 10 + 5 bytes; step 1: only the second, context 4: 10 + 4
    bound = engine_throughput.bandwidth_bound([[7, 7], [7, 7, 7]], [1, 2], weight_bytes=10, kv_per_token=1,
                                              bandwidth=1.0)
    assert bound == pytest.approx(3 / 29)


def test_swept_tilings_give_each_projection_its_sweeps_best_at_the_covering_rows(tmp_path):
    cfg = PRESETS["qwen3-0.6b"]
    E, qkv, inter = cfg.hidden_size, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim, \
        cfg.intermediate_size

    def best(k):  # a tiling per (rows, projection) that no default gives: k tells them apart
        return {name: Blocks(16, k + i, 8, 3, True, 2) for i, name in enumerate(["qkv", "o", "gate_up", "down"])}

    sweep = {"rows": {str(rows): {"projections": [{"projection": name, "best": vars(b)} for name, b in
                                                  best(k).items()]} for rows, k in ((4, 100), (8, 200))}}
    (tmp_path / "blocks.json").write_text(json.dumps(sweep))
    tuned = engine_throughput.swept_tilings(str(tmp_path / "blocks.json"), cfg)
    cpu = torch.device("cpu")
    assert tuned(qkv, E, cpu, heads=qkv // cfg.head_dim, rows=3) == best(100)["qkv"]
    assert tuned(E, qkv - 2 * cfg.num_key_value_heads * cfg.head_dim, cpu, rows=4) == best(100)["o"]
    assert tuned(inter, E, cpu, rows=5, paired=True) == best(200)["gate_up"]
    assert tuned(E, inter, cpu, rows=8) == best(200)["down"]
    for args, kwargs in [((E, inter, cpu), {"rows": 2}),  # below the sweep's rows, in the vector tiles' range
                         ((E, inter, cpu), {"rows": 9}),  # above them
                         ((E, inter, cpu, False), {"rows": 8}),  # no split's counts to hand
                         ((E, 512, cpu), {"rows": 8})]:  # a projection of another shape
        assert tuned(*args, **kwargs) == default_blocks(*args, **kwargs)
