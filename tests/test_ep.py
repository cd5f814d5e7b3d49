"""Expert parallelism on CPU (gloo, real processes): EP=2, EP=3 and TP=2 x EP=2 generate exactly what one rank
does, also when every token routes to one rank's experts; ranks that route differently are stopped by the lockstep
sentinel (and without it would mix two routings silently); a rank stuck in an expert all-reduce is named by
`tandem analyze`."""

import asyncio
import faulthandler
import functools

import pytest
import torch
import torch.distributed as dist
from test_tp import RANK_STACKS_S, generate, mixed_requests, run_ranks, run_until_watchdogs_end

from tandem.config import PRESETS, EngineConfig
from tandem.distributed import faults
from tandem.engine.engine import Engine
from tandem.engine.lockstep import LockstepError
from tandem.model import moe
from tandem.run.tp import engine_or_follow, init_tp

MODEL = PRESETS["tiny-moe"]  # 6 experts, 2 per token, layer 0 dense
POOL = EngineConfig(page_size=4, num_pages=40, max_prefill_tokens=32)


def one_sided(logits, k, normalize, recorded=None):
    """Routing that sends every token to experts 3..5 (rank 1's of two): the load-imbalance case."""
    weights, ids = moe_route(logits, k, normalize)
    return weights, ids % 3 + 3


class SkewedAfter:
    """Routing that differs (every id shifted by one) from the `calls`-th call of this process on."""

    def __init__(self, calls: int):
        self.calls, self.count = calls, 0

    def __call__(self, logits, k, normalize, recorded=None):
        weights, ids = moe_route(logits, k, normalize)
        self.count += 1
        return weights, (ids + 1) % MODEL.num_experts if self.count > self.calls else ids


moe_route = moe.route


def _rank_main(rank, port, results, size, ep, config, route, work=generate):
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(RANK_STACKS_S, exit=True)
    tp = init_tp(rank, size, f"tcp://127.0.0.1:{port}", "gloo", ep=ep)
    if route is not None and (route[0] is None or route[0] == rank):  # (rank, routing) or (None: every rank, ...)
        moe.route = route[1]
    engine = engine_or_follow("tiny-moe", config, tp)
    if engine is not None:
        try:
            results.put(work(engine, mixed_requests())[0])
        except Exception as e:  # noqa: BLE001 (the test asserts on it)
            results.put(e)
        finally:
            engine.shutdown()
    dist.destroy_process_group()


def run_ep(size, ep, config=POOL, route=None, work=generate):
    return run_ranks(functools.partial(_rank_main, size=size, ep=ep, config=config, route=route, work=work), size,
                     ())[0]


def run_one(route=moe_route, config=POOL, work=generate):
    moe.route = route
    try:
        with Engine("tiny-moe", config) as engine:
            return work(engine, mixed_requests())[0]
    finally:
        moe.route = moe_route


def then_updated(engine, requests):
    """Generate; then load another model's weights in place from flat buckets, as a transport delivers them (the
    experts stacked, as a trainer sends them: every rank keeps its experts), and generate again."""
    from tandem.model.loader import build_model
    from tandem.transport.weights import FlatTensors

    before, _ = generate(engine, requests)
    named = list(build_model("tiny-moe", seed=7).named_parameters())
    halves = [named[:9], named[9:]]
    flat = FlatTensors([([n for n, _ in h], [list(t.shape) for _, t in h],
                         torch.cat([t.detach().reshape(-1) for _, t in h])) for h in halves])
    asyncio.run(engine.load_paused(flat, 1, "in_place"))
    return before + generate(engine, requests)[0], None


def assert_same(got, expected):
    for (ids, lps, fin), (ids_ep, lps_ep, fin_ep) in zip(expected, got, strict=True):
        assert ids_ep == ids and fin_ep == fin
        assert lps_ep == pytest.approx(lps, abs=1e-4)


@functools.cache
def one_rank():
    """`mixed_requests` on one engine: the reference of (3, 3) and (4, 2) below (computed once; only read)."""
    return run_one()


@pytest.mark.parametrize(("size", "ep"), [(2, 2), (3, 3), (4, 2)])
def test_expert_parallel_ranks_generate_what_one_rank_does(size, ep):
    """Greedy and seeded sampling, shared prefixes and retraction; (4, 2) is TP=2 x EP=2. At EP=2 also after a
    weight update, which reaches every rank's experts."""
    if (size, ep) != (2, 2):
        assert_same(run_ep(size, ep), one_rank())
        return
    expected = run_one(work=then_updated)
    assert_same(run_ep(2, 2, work=then_updated), expected)
    half = len(expected) // 2
    assert [ids for ids, _, _ in expected[:half]] != [ids for ids, _, _ in expected[half:]]  # the update mattered


def test_every_token_routed_to_one_ranks_experts_still_matches():
    assert_same(run_ep(2, 2, route=(None, one_sided)), run_one(one_sided))


def test_ranks_that_route_differently_are_stopped_by_the_sentinel():
    """Rank 1 routes differently from some step on: the sentinel names it and the routing. (Without the routing in
    the digest nothing else would: the all-reduced sums agree on every rank, the outputs silently those of
    neither routing, and this test fails.)"""
    stopped = run_ep(2, 2, route=(1, SkewedAfter(40)))
    errors = [fin["message"] for _, _, fin in stopped if fin["type"] == "abort"]  # the requests still running
    assert errors and all("'routing'" in e and "rank(s) [1]" in e for e in errors), stopped


def test_the_routing_is_in_the_digest():
    assert LockstepError  # (the sentinel's error type, raised above through the engine)
    from tandem.engine.lockstep import DIGEST_FIELDS, step_digest
    assert "routing" in DIGEST_FIELDS
    assert step_digest(1, [], [], 0, 0, None, 5)["routing"] != step_digest(1, [], [], 0, 0, None, 6)["routing"]


def _hang_rank_main(rank, size, port, dump_dir, plan):
    torch.set_num_threads(1)
    faults.configure(plan)
    tp = init_tp(rank, size, f"tcp://127.0.0.1:{port}", "gloo", ep=size)
    config = EngineConfig(page_size=4, num_pages=600, dump_dir=str(dump_dir), watchdog_timeout_s=1.0,
                          watchdog_action="abort")
    engine = engine_or_follow("tiny-moe", config, tp)
    if engine is not None:
        generate(engine, mixed_requests())  # never returns: the watchdog ends the process


def test_a_rank_that_skips_an_expert_all_reduce_is_named_by_the_analyzer(tmp_path):
    from tandem.distributed.analyzer import analyze

    seq = 30
    run_until_watchdogs_end(_hang_rank_main, 2, tmp_path, faults.FaultPlan(rank=1, action="skip", seq=seq, group="ep"))
    verdict = analyze(tmp_path)
    # (gloo pairs rank 1's next all-reduce of the layer with the one it skipped, so the ranks part at the next
    # one at the latest: the first that rank 1 never issued)
    assert verdict.culprits == (1,) and verdict.pg == "ep" and seq <= verdict.seq <= seq + 1, verdict.text()
