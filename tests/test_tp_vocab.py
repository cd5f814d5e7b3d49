"""Tensor parallelism at a vocabulary size no TP size divides (GPT-2's 50,257): TP=2 and TP=3 engines generate
what TP=1 generates. One launch of three processes serves both sizes: the TP=3 engine on ranks 0-2, then the TP=2
engine on ranks 0-1 (CPU, gloo)."""

import dataclasses
import datetime
import faulthandler

import pytest
import torch
import torch.distributed as dist
from test_tp import generate, run_ranks

from tandem.config import EngineConfig, ModelConfig
from tandem.distributed.parallel import TPGroup
from tandem.engine.engine import Engine
from tandem.run.tp import engine_or_follow
from tandem.types import SamplingParams

# heads and intermediate size divisible by 2 and 3; the vocabulary by neither (ranks hold 25,129 or 16,753 rows)
CONFIG = ModelConfig(vocab_size=50_257, hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=6, num_key_value_heads=6, head_dim=4, tie_word_embeddings=True,
                     rope_theta=10000.0)
POOL = EngineConfig(page_size=4, num_pages=32, max_prefill_tokens=32)
LAST_RANK_OF_3 = 2 * 16_753  # the first id the TP=3 rank 2 owns (its last 2 rows are padding)


def requests():
    # ids on both sides of every rank boundary, and the last id
    edges = [0, 16_752, 16_753, 25_128, 25_129, 33_505, 33_506, 50_256]
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=3)
    return [(edges, greedy), (edges[::-1], greedy), ([7, 50_000, 9], seeded)]


def _rank_main(rank, port, results):
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(100, exit=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=60))
    groups = {size: [dist.new_group(list(range(size)), backend="gloo") for _ in range(2)] for size in (3, 2)}
    for size, (data, ctrl) in groups.items():
        if rank >= size:
            continue
        engine = engine_or_follow(CONFIG, POOL, TPGroup(rank, size, data, ctrl))
        if engine is not None:
            results.put((size, generate(engine, requests())[0]))
            engine.shutdown()
    dist.destroy_process_group()


def run_tp_2_and_3(timeout=120) -> dict[int, list]:
    return dict(run_ranks(_rank_main, 3, (), num_results=2, timeout=timeout))


def test_tp2_and_tp3_generate_what_tp1_generates_at_an_indivisible_vocabulary():
    with Engine(CONFIG, POOL) as engine:
        expected, _ = generate(engine, requests())
    assert any(t >= LAST_RANK_OF_3 for ids, _, _ in expected for t in ids), "should sample the last rank's ids"
    got = run_tp_2_and_3()
    for size in (2, 3):
        for (ids, lps, fin), (ids_tp, lps_tp, fin_tp) in zip(expected, got[size], strict=True):
            assert ids_tp == ids and fin_tp == fin, size
            assert lps_tp == pytest.approx(lps, abs=1e-4)


def test_an_engine_refuses_heads_its_tp_size_does_not_divide():
    """Checked when the model is built, before any process group is used: a ValueError naming the field."""
    config = dataclasses.replace(CONFIG, num_attention_heads=4, num_key_value_heads=4)
    with pytest.raises(ValueError, match="num_attention_heads"):
        Engine(config, POOL, tp=TPGroup(0, 3))
