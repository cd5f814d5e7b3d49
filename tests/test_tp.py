"""Tensor parallelism on CPU (gloo, real processes): TP=2 and TP=3 generate exactly what TP=1 does, and the
sampled-token broadcast and the lockstep sentinel each prove their worth against injected token flips."""

import asyncio
import dataclasses
import datetime
import faulthandler
import functools
import json
import multiprocessing
import os
import queue
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tandem.config import EngineConfig, ModelConfig
from tandem.distributed import faults
from tandem.distributed.parallel import TPGroup
from tandem.engine.engine import Engine
from tandem.run.tp import engine_or_follow, init_tp
from tandem.types import SamplingParams

# divisible by 2 and 3 where TP splits: heads, KV heads, intermediate size, vocabulary
CONFIG = ModelConfig(vocab_size=384, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                     num_attention_heads=12, num_key_value_heads=6, head_dim=16, max_position_embeddings=4096,
                     rope_theta=10000.0)
SMALL_POOL = EngineConfig(page_size=4, num_pages=40, max_prefill_tokens=32)


def mixed_requests():
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(2, 384, (30,), generator=gen).tolist()
    reqs = []
    for i in range(10):
        prompt = (prefix if i % 2 else []) + torch.randint(2, 384, (5 + 3 * i,), generator=gen).tolist()
        sampling = (SamplingParams(temperature=0, max_new_tokens=8 + 2 * i, ignore_eos=True) if i % 3 else
                    SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=12, seed=100 + i, ignore_eos=True))
        reqs.append((prompt, sampling))
    return reqs


def long_requests(n=1000):
    return [([5, 6, 7, i], SamplingParams(temperature=1.0, max_new_tokens=n, seed=i, ignore_eos=True))
            for i in range(2)]


def generate(engine, requests):
    async def go():
        return await asyncio.gather(*[engine.generate(p, sp) for p, sp in requests])

    outs = asyncio.run(go())
    retractions = sum(o.num_retractions for o in outs)
    return [(o.output_ids, o.output_logprobs, o.finish_reason.to_dict()) for o in outs], retractions


def two_turns(engine, requests):
    """Every request, then its next turn (history plus new tokens): with a small pool the second turn's history
    comes back from the host tier."""
    first, retractions = generate(engine, requests)
    later = [(p + ids + [7, 8, 9], sp) for (p, sp), (ids, _, _) in zip(requests, first, strict=True)]
    second, more = generate(engine, later)
    return first + second, retractions + more


BACKEND = os.environ.get("TANDEM_TP_BACKEND", "gloo")  # "nccl" on a machine with a GPU per rank


RANK_STACKS_S = 100  # a rank still running then prints every thread's stack (before run_tp gives up at 120 s)


def _rank_main(rank, port, results, size, make_requests, config, plan, work=generate):
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(RANK_STACKS_S, exit=True)
    if BACKEND == "nccl":  # the model's collectives on NCCL, one GPU per rank; the control channel stays gloo
        torch.cuda.set_device(rank)
        tp = init_tp(rank, size, f"tcp://127.0.0.1:{port}", "nccl")
        config = dataclasses.replace(config, device="cuda")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=60))
        tp = TPGroup(rank, size)
    faults.configure(plan)
    engine = engine_or_follow(CONFIG, config, tp)
    if engine is not None:
        results.put(work(engine, make_requests()))
        engine.shutdown()
    dist.destroy_process_group()


def rank_processes():
    """The multiprocessing context rank processes start in: forked from multiprocessing's fork server, which imported
    torch, the engine and the trainer once, instead of each rank a fresh interpreter importing them again (about
    2.5 s of CPU a rank). Nothing runs in the server but those imports (no process group, device or work), so a
    fork of it is as clean as a DataLoader worker's; the rank then imports its test module as a spawned one would.
    (The server does not get the tests' directory on its path: it preloads packages only; one it cannot import is
    skipped.) Ranks on GPUs (TANDEM_TP_BACKEND=nccl) are spawned as before: nothing may have touched CUDA before
    their fork, and the GPU run is no place to find out that an import did."""
    if BACKEND == "nccl":
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "tandem.engine.engine", "tandem.run.tp",
                                "tandem.distributed.faults", "tandem.trainer.trainer"])  # (read as the server starts)
    return ctx


def run_ranks(target, num_procs, args, num_results=1, timeout=120) -> list:
    """Spawn `target(rank, port, *args, results)` for every rank (a free port for their process group) and
    return the first `num_results` things they put in `results`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = rank_processes()
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, *args, results)) for r in range(num_procs)]
    for p in procs:
        p.start()
    try:
        return [results.get(timeout=timeout) for _ in range(num_results)]
    except queue.Empty:
        raise AssertionError(f"{num_procs} ranks produced no result within {timeout} s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


def run_tp(size, make_requests, config=SMALL_POOL, plan=None, timeout=120, work=generate):
    return run_ranks(functools.partial(_rank_main, size=size, make_requests=make_requests, config=config, plan=plan,
                                       work=work), size, (), timeout=timeout)[0]


def run_single(make_requests, config=SMALL_POOL):
    if BACKEND == "nccl":  # the reference on the same kind of device: random weights are drawn where they live
        config = dataclasses.replace(config, device="cuda")
    with Engine(CONFIG, config) as engine:
        return generate(engine, make_requests())


@functools.cache
def tp1_mixed():
    """`mixed_requests` on one rank: the reference of both sizes below (computed once; only read)."""
    return run_single(mixed_requests)


@pytest.mark.parametrize("size", [2, 3])
def test_tp_generates_what_tp1_generates(size):
    """Greedy and seeded sampling, shared prefixes (prefix cache) and a pool small enough to force retraction."""
    (expected, retractions) = tp1_mixed()
    assert retractions > 0, "the scenario should exercise retraction"
    got, _ = run_tp(size, mixed_requests)
    for (ids, lps, fin), (ids_tp, lps_tp, fin_tp) in zip(expected, got, strict=True):
        assert ids_tp == ids and fin_tp == fin
        assert lps_tp == pytest.approx(lps, abs=1e-4)


def _updated_then_generate(engine, requests):
    """Load another model's weights in place from flat buckets, as a weight transport delivers them (every TP rank
    gets them through rank 0's published command and keeps its slice), then generate."""
    from tandem.model.loader import build_model
    from tandem.transport.weights import FlatTensors

    named = [(n, p.detach().to(engine.pool.k_cache.device)) for n, p in build_model(CONFIG, seed=7).named_parameters()]
    halves = [named[:5], named[5:]]
    flat = FlatTensors([([n for n, _ in h], [list(t.shape) for _, t in h], torch.cat([t.reshape(-1) for _, t in h]))
                        for h in halves])
    asyncio.run(engine.load_paused(flat, 1, "in_place"))
    return generate(engine, requests)


def test_tp_loads_flat_weight_buckets_as_tp1_does():
    """A weight update received as flat buckets (`FlatTensors`): TP=2 splits them across its ranks and then
    generates what TP=1 generates after the same update (whose loader copies whole buckets piece by piece)."""
    if BACKEND == "nccl":
        pytest.skip("the reference below runs on the CPU")
    with Engine(CONFIG, SMALL_POOL) as engine:
        expected, _ = _updated_then_generate(engine, mixed_requests())
    got, _ = run_tp(2, mixed_requests, work=_updated_then_generate)
    with Engine(CONFIG, SMALL_POOL) as engine:  # the update really changed what is generated
        before, _ = generate(engine, mixed_requests())
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in expected] != [ids for ids, _, _ in before]


def test_tp_with_a_host_tier_generates_what_tp1_generates():
    """Every rank takes the same tier decisions (the reap point comes from rank 0, the sentinel compares the
    tier's state every step), so the ranks' page tables stay the same and the outputs equal TP=1's."""
    config = dataclasses.replace(SMALL_POOL, host_cache="write_through", host_cache_pages=64)
    with Engine(CONFIG, dataclasses.replace(config, device="cuda") if BACKEND == "nccl" else config) as engine:
        expected, _ = two_turns(engine, mixed_requests())
        assert asyncio.run(engine.get_stats()).host_pages_loaded > 0, "the scenario should load pages back"
    got, _ = run_tp(2, mixed_requests, config, work=two_turns)
    for (ids, lps, fin), (ids_tp, lps_tp, fin_tp) in zip(expected, got, strict=True):
        assert ids_tp == ids and fin_tp == fin
        assert lps_tp == pytest.approx(lps, abs=1e-4)


def generate_counting_graphs(engine, requests):
    """`generate`, with how many decode graphs the engine captured and how many replays its recorder holds."""
    outs = generate(engine, requests)
    records = [e for e in engine.recorder.entries() if e["profiling_name"].endswith(":cuda_graph")]
    return outs, len(engine.runner.graphs), len(records), records[-1]["info"] if records else None


@pytest.mark.gpu
@pytest.mark.skipif(BACKEND != "nccl", reason="CUDA graphs under TP need NCCL (TANDEM_TP_BACKEND=nccl)")
def test_nccl_tp_replays_decode_graphs_with_their_collectives_and_records_each_replay():
    """Decode steps of a TP=2 engine replay CUDA graphs with NCCL's all-reduces inside them, and still generate
    what one GPU generates; the flight recorder has one record per replay, standing for its collectives."""
    short = functools.partial(long_requests, 200)
    expected, _ = run_single(short, EngineConfig(page_size=4, num_pages=600))
    (got, _), num_graphs, num_replays, info = run_tp(2, short, EngineConfig(page_size=4, num_pages=600),
                                                    work=generate_counting_graphs)
    assert num_graphs > 0 and num_replays >= 190, (num_graphs, num_replays)
    assert info["collectives"] == 2 * CONFIG.num_hidden_layers + 2, info  # 2 per layer, embedding, head
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in expected]


FLIPS = faults.FaultPlan(flip_rank=1, flip_prob=0.05, flip_seed=3)


def test_without_the_broadcast_the_sentinel_names_the_diverging_rank():
    no_broadcast = EngineConfig(page_size=4, num_pages=600, token_broadcast=False)
    (outs, _) = run_tp(2, long_requests, no_broadcast, FLIPS)
    first_flip = next(k for k in range(1, 10_000) if faults.should_flip(k, 1, FLIPS))
    message = outs[0][2].get("message", "")
    assert "LockstepError" in message and "rank(s) [1]" in message and "'tokens'" in message, message
    step = int(message.split("step ")[1].split(":")[0])
    assert step <= first_flip + 2, (step, first_flip)  # caught at the first digest after the flip


def test_without_either_protection_the_same_flips_diverge_silently():
    """The mutation that shows what the two protections are for: no error, wrong tokens."""
    neither = EngineConfig(page_size=4, num_pages=600, token_broadcast=False, lockstep_sentinel=False)
    short = functools.partial(long_requests, 100)  # (rank 1's tokens flip at 8 of these steps, the first at step 3)
    expected, _ = run_single(short, neither)
    got, _ = run_tp(2, short, neither, FLIPS)
    assert all(fin == {"type": "length", "length": 100} for _, _, fin in got)  # nobody noticed...
    # ...but rank 1 fed its flipped tokens back in, its partial sums of every later step were computed on
    # another sequence, and the all-reduces carried that into rank 0's outputs
    assert [ids for ids, _, _ in got] != [ids for ids, _, _ in expected]


def test_with_the_broadcast_flips_never_diverge_over_hundreds_of_steps():
    broadcast = EngineConfig(page_size=4, num_pages=600)
    steps = functools.partial(long_requests, 200)
    expected, _ = run_single(steps, broadcast)
    got, _ = run_tp(2, steps, broadcast, FLIPS)
    assert sum(faults.should_flip(k, 1, FLIPS) for k in range(1, 201)) > 10  # flips were injected (12 of them)
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in expected]
    assert all(fin == {"type": "length", "length": 200} for _, _, fin in got)


def run_until_watchdogs_end(target, size, dump_dir, plan) -> list:
    """Spawn `target(rank, size, port, dump_dir, plan)` for every rank and wait for all to end (their watchdogs end
    them when they hang); fail if one outlives 90 s. Returns the processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = rank_processes()
    procs = [ctx.Process(target=target, args=(r, size, port, dump_dir, plan)) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
        if p.is_alive():
            p.terminate()
            raise AssertionError("a hung rank was not ended by its watchdog")
    return procs


def _hang_rank_main(rank, size, port, dump_dir, plan):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    faults.configure(plan)
    tp = TPGroup(rank, size, dist.new_group(backend="gloo", group_desc="tp"),
                 dist.new_group(backend="gloo", group_desc="ctrl"))
    config = EngineConfig(page_size=4, num_pages=600, dump_dir=str(dump_dir), watchdog_timeout_s=WATCHDOG_S,
                          watchdog_action="abort")
    engine = engine_or_follow(CONFIG, config, tp)
    if engine is not None:
        generate(engine, long_requests())  # never returns: the watchdog ends the process


WATCHDOG_S = 1.0
HANG_TRIALS = int(os.environ.get("TANDEM_HANG_TRIALS", "2"))


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("trial", range(HANG_TRIALS))
def test_a_rank_that_skips_a_collective_is_named_by_the_analyzer(tmp_path, trial, size):
    """Rank 1 skips the model's collective number `seq` on the "tp" group; the ranks then wait in different
    collectives (a real deadlock). Every rank's watchdog dumps within twice its timeout, and `tandem analyze`
    names rank 1 and the collective. (TANDEM_HANG_TRIALS=10 repeats it.)"""
    from tandem.distributed.analyzer import analyze

    seq = 40 + 7 * trial
    procs = run_until_watchdogs_end(_hang_rank_main, size, tmp_path, faults.FaultPlan(rank=1, action="skip",
                                                                                       seq=seq, group="tp"))
    verdict = analyze(tmp_path)
    assert verdict.culprits == (1,) and verdict.pg == "tp" and verdict.seq == seq, verdict.text()
    # a rank the watchdog ended (exit 70) dumped first, within twice its timeout; where the shifted calls pair
    # up with different sizes gloo fails the call (the engine aborts its requests) or the process instead, and
    # the journal is the evidence
    for rank, p in enumerate(procs):
        assert list(tmp_path.glob(f"tandem_fr.*.rank{rank}.jsonl"))
        if p.exitcode == 70:
            dumps = list(tmp_path.glob(f"tandem_dump.*.rank{rank}.*.json"))
            assert json.loads(dumps[0].read_text())["state"]["watchdog"]["stalled_s"] <= 2 * WATCHDOG_S


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="followers die with their parent on Linux")
def test_a_follower_whose_rank_0_ended_does_not_wait_for_it(tmp_path):
    """A rank 0 that ends without clean-up (killed, crashed) right after starting its follower: the follower ends too,
    where it would otherwise wait up to 30 minutes for a store that is gone (holding its GPU, and any pipe it
    inherited)."""
    code = ("import os; from tandem.config import EngineConfig; from tandem.run.tp import rendezvous_store, "
            "start_followers; store = rendezvous_store(); "
            "[p] = start_followers(2, store, 'gloo', 'tiny', EngineConfig()); print(p.pid, flush=True); os._exit(0)")
    with open(tmp_path / "out", "w") as out:  # (a file: a pipe would stay open as long as the follower lives)
        subprocess.run([sys.executable, "-c", code], stdout=out, timeout=60, check=True)
    pid = int((tmp_path / "out").read_text().split()[0])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        assert not _alive(pid), f"follower {pid} outlived its rank 0"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's exit waits for whoever adopts it to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_rank_0_names_a_follower_that_ended_before_joining():
    """Where rank 0 would wait for it the whole join timeout (30 minutes) in the rendezvous, it names the follower and
    its exit code at once (here a follower that refuses its grid: ep 3 does not divide 2 ranks)."""
    from tandem.run.tp import await_followers, rendezvous_store, start_followers

    store = rendezvous_store()
    [p] = start_followers(2, store, "gloo", "tiny", EngineConfig(), ep=3)
    try:
        with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {p.pid}\) exited with code 1 before joining"):
            await_followers(store, [p], timeout_s=60)
    finally:
        p.kill()
