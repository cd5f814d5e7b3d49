"""The engine-throughput benchmark's bandwidth bound (issue 27) against a hand computation."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "engine_throughput", Path(__file__).parents[1] / "benchmarks" / "engine_throughput.py")
engine_throughput = importlib.util.module_from_spec(spec)
spec.loader.exec_module(engine_throughput)


def test_bound_reads_the_weights_and_the_running_kv_each_step():
    # step 0: both sequences run, contexts 2 and 3: 10 + 5 bytes; step 1: only the second, context 4: 10 + 4
    bound = engine_throughput.bandwidth_bound([[7, 7], [7, 7, 7]], [1, 2], weight_bytes=10, kv_per_token=1,
                                              bandwidth=1.0)
    assert bound == pytest.approx(3 / 29)
