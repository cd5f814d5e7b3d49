"""Placement "separate": the engine in a process of its own behind HTTP, weights over a gloo group (NCCL's CPU
stand-in) or by reference through a pipe to its process (shared memory here, CUDA IPC on one GPU), a few steps
of the random agent end to end; failures of the engine's process reach the trainer as errors naming it, within the
timeouts; and the pipelined sender delivers exactly what the unpipelined one does. Placement "colocated": a refused
push and the next one."""

import asyncio
import concurrent.futures
import copy
import dataclasses
import gc
import os
import re
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from test_transport import digest, free_port, run_pair

from tandem.config import RunConfig
from tandem.model.loader import build_model
from tandem.run.heap import frozen_heap
from tandem.run.loop import Run
from tandem.run.placement import place
from tandem.transport import dist as weights_dist
from tandem.transport.dist import DistReceiver, DistSender
from tandem.transport.weights import TransportError
from tandem.types import SamplingParams

SMALL = ["placement=separate", "rollout.group_size=2", "rollout.batch_groups=2", "rollout.num_in_flight=8",
         "random_agent.prompt_len_max=40", "random_agent.response_len_median=6", "random_agent.response_len_max=64",
         "random_agent.max_context=256", "weight_bucket_bytes=65536"]


def make_run(tmp_path, *overrides) -> Run:
    return Run(RunConfig.load(None, [*SMALL, f"out_dir={tmp_path}", *overrides]))


@pytest.mark.parametrize("overrides, message", [
    (["placement=apart"], "run.placement: must be auto, colocated, separate, disaggregated or ray"),
    (["placement=separate", "trainer_device=cuda:0"], "must both be on CUDA (NCCL) or both on the CPU"),
    (["placement=separate", "trainer_device=cuda", "engine.device=cuda:0", "weight_transport=group"],
     "group needs two GPUs"),
    (["placement=separate", "trainer_device=cuda:0", "engine.device=cuda:1", "weight_transport=ipc"],
     "ipc needs the trainer (cuda:0) and the engine (cuda:1) on the same device"),
    (["weight_transport=ipc"], "run.weight_transport: ipc is for placement separate"),
    (["weight_transport=pipe"], "run.weight_transport: must be auto, group or ipc"),
    (["weight_bucket_bytes=0"], "run.weight_bucket_bytes: must be positive"),
])
def test_bad_placement_is_a_value_error_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RunConfig.load(None, overrides)


@pytest.mark.parametrize("overrides, placement", [
    ([], "colocated"),  # CPU development
    (["trainer_device=cuda", "engine.device=cuda:0"], "separate"),  # one GPU
    (["trainer_device=cuda:0", "engine.device=cuda:1"], "separate"),
    (["trainer_device=cpu", "engine.device=cuda:0"], "colocated"),  # (separate needs both on CUDA or both not)
    (["rollout.num_engines=2"], "separate"),  # replicas
    (["rollout.restart_engines=true"], "separate"),
    (["placement=colocated", "engine.device=cuda:0"], "colocated"),  # asked for: kept
])
def test_the_default_placement_is_separate_with_both_on_cuda_else_colocated(overrides, placement):
    cfg = RunConfig.load(None, overrides)
    assert cfg.placement == placement
    assert dataclasses.replace(cfg).placement == placement  # (decided once: a copy keeps it)


def test_one_gpu_for_both_defaults_to_the_ipc_transport():
    cfg = RunConfig.load(None, ["placement=separate", "trainer_device=cuda", "engine.device=cuda:0"])
    assert cfg.resolved_weight_transport == "ipc"
    assert RunConfig.load(None, ["placement=separate"]).resolved_weight_transport == "group"


@pytest.mark.parametrize("transport", ["group", "ipc", pytest.param("ipc on one GPU", marks=pytest.mark.gpu)])
def test_separate_engine_follows_the_trainer_and_samples_with_its_weights(tmp_path, transport, capfd):
    """Over a gloo group, or (ipc) by reference through the pipe: shared memory here, CUDA IPC on one GPU. The
    engine's process stops cleanly, and quietly: no report of objects its frozen heap kept past its exit."""
    where = ["trainer_device=cuda:0", "engine.device=cuda:0"] if "GPU" in transport else [
        f"weight_transport={transport}"]
    run = make_run(tmp_path, "steps=4", "rollout.max_staleness=1", "weight_sync_timeout_s=30", *where)
    snapshots = {0: copy.deepcopy(run.trainer.model)}  # the trainer's weights of every version
    batches = []
    run.on_batch = lambda version, batch: batches.append(batch)
    engine, free = run.placement.process, []
    if transport == "group":  # the group's port is held from its choice on: no other process can take it first
        join = run.placement.engine.init_weights_update_group

        def racing(host, port, *args):
            with socket.socket() as s:
                try:
                    s.bind((host, port))  # (another process taking the port)
                    free.append(True)
                except OSError:
                    free.append(False)
            return join(host, port, *args)
        run.placement.engine.init_weights_update_group = racing
    try:
        history = asyncio.run(run.train(lambda r: snapshots.update({r["step"]: copy.deepcopy(run.trainer.model)})))
    finally:
        run.shutdown()
    assert engine.pid != os.getpid() and engine.process.exitcode == 0  # its own process, stopped cleanly
    assert "leaked" not in capfd.readouterr().err  # (nanobind's report of Triton's objects, the heap left frozen)
    assert free == ([False] if transport == "group" else []), "the weight group's port was free before it was used"

    # the engine's own version (from its stats, over HTTP) follows the trainer's after every step
    assert [(h["step"], h["version"]) for h in history] == [(s, s) for s in range(1, 5)]
    num_bytes = sum(p.numel() * p.element_size() for p in run.trainer.model.parameters())
    for h in history:  # (ipc: the trainer waits only for the post; `applied_s` until the engine's reply)
        assert h["sync_bytes"] == num_bytes and 0 < h["transfer_s"] <= h["sync_s"] and h["pause_s"] > 0
        assert h["pause_s"] < (h["applied_s"] if "ipc" in transport else h["sync_s"])

    # every sampled token's behaviour logprob is the trainer's logprob under the weights of the token's version
    # (pause mode retract: no token attends to KV of older weights), so the weights crossed exactly
    episodes = [e for batch in batches for g in batch for e in g.episodes]
    behav = torch.tensor([lp for e in episodes for lp in e.behav_logprobs[1:]])
    versions = torch.tensor([v for e in episodes for v in e.versions[1:]])
    compared = torch.zeros_like(versions, dtype=torch.bool)
    for version, model in snapshots.items():
        mask = versions == version
        with torch.no_grad():
            every = torch.ones(len(versions), dtype=torch.bool, device=run.trainer.device)
            logprobs = run.trainer._token_logprobs(model, episodes, every)
        assert torch.allclose(logprobs[mask].cpu(), behav[mask], atol=1e-3 if where[0].startswith("trainer") else 1e-4,
                              rtol=0), version
        compared |= mask
    assert compared.sum() == (versions >= 0).sum()
    assert (versions >= 1).sum() > 0, "no token was sampled after an update"


def test_an_engine_that_does_not_start_in_time_is_named_and_stopped(tmp_path):
    """Start-up has a bound of its own (engine_start_timeout_s, not the short engine_timeout_s that detects a hung
    engine): past it the run fails naming the engine process, which is stopped."""
    with pytest.raises(Exception, match=r"engine process pid \d+: not serving within 0.5 s") as failure:
        make_run(tmp_path, "engine_start_timeout_s=0.5", "engine_timeout_s=60")
    pid = int(re.search(r"pid (\d+)", str(failure.value)).group(1))

    def running() -> bool:  # (a zombie has stopped)
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running()


@pytest.mark.parametrize("signal_name, when", [("SIGKILL", "before joining"), ("SIGKILL", "between steps"),
                                               ("SIGSTOP", "between steps"), ("SIGSTOP", "before a sync")])
def test_engine_failure_is_an_error_naming_it_within_the_timeouts(tmp_path, signal_name, when):
    """The engine's process killed (SIGKILL) or frozen (SIGSTOP: alive but silent, the hang case) before the weight
    group forms, between steps (synchronous RL: the trainer then waits for generation, the monitor watches), or just
    before a weight sync: the trainer gets an error naming the engine, within the timeouts."""
    sync_timeout_s, engine_timeout_s = 3.0, 4.0
    # the tool's latency keeps every episode of the next batch in flight when the engine fails between steps
    run = make_run(tmp_path, "steps=3", "rollout.max_staleness=0", f"weight_sync_timeout_s={sync_timeout_s}",
                   f"engine_timeout_s={engine_timeout_s}", "random_agent.tool_latency_s=0.3")
    engine, sig, hit = run.placement.process, getattr(signal, signal_name), {}

    def hit_engine():
        if not hit:
            hit["t"] = time.monotonic()
            os.kill(engine.pid, sig)

    on_step = None
    if when == "before joining":
        hit_engine()
    elif when == "between steps":
        on_step = lambda record: hit_engine()
    else:
        run.on_batch = lambda version, batch: version == 1 and hit_engine()
    try:
        with pytest.raises(Exception) as failure:
            asyncio.run(run.train(on_step))
        elapsed = time.monotonic() - hit["t"]
    finally:
        if sig == signal.SIGSTOP:
            os.kill(engine.pid, signal.SIGCONT)  # lets it stop cleanly
        run.shutdown()
    message = str(failure.value)
    print(f"\n{signal_name} {when}: {type(failure.value).__name__} after {elapsed:.1f} s: {message}")
    assert engine.url in message, message
    assert run.engine._http is None, "the client's connections were left open"
    assert elapsed < max(sync_timeout_s, engine_timeout_s) + 3, (elapsed, message)
    if when == "between steps":  # the groups the dead engine cut short are listed to run again, not dropped
        manager = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["manager"]
        assert manager["dropped"] == {} and manager["rerun"], manager
    if when == "before joining":
        assert "rank 1 did not join tcp://127.0.0.1" in message
        assert f"pid {engine.pid} at {engine.url}: exited with code -9" in message
    elif when == "before a sync":
        assert f"rank 1 (engine pid {engine.pid} at {engine.url}) did not start receiving" in message
        assert "is still running" in message
    elif sig == signal.SIGSTOP:
        assert "/health unanswered" in message and "stopped or stuck" in message


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP"])
def test_ipc_engine_killed_or_frozen_before_a_sync_is_named_within_the_timeouts(tmp_path, signal_name):
    """The same failures with the weights handed over through the pipe: the trainer does not wait forever."""
    run = make_run(tmp_path, "steps=3", "rollout.max_staleness=0", "weight_sync_timeout_s=3", "engine_timeout_s=4",
                   "weight_transport=ipc")
    engine, sig, hit = run.placement.process, getattr(signal, signal_name), {}

    def hit_engine(version, batch):
        if version == 1 and not hit:
            hit["t"] = time.monotonic()
            os.kill(engine.pid, sig)
            if sig == signal.SIGKILL:  # dead before the push: its post finds the pipe closed, yet names the exit
                engine.process.join(5)

    run.on_batch = hit_engine
    try:
        with pytest.raises(Exception) as failure:
            asyncio.run(run.train())
        elapsed = time.monotonic() - hit["t"]
    finally:
        if sig == signal.SIGSTOP:
            os.kill(engine.pid, signal.SIGCONT)
        run.shutdown()
    message = str(failure.value)
    assert engine.url in message and elapsed < 4 + 3, (elapsed, message)
    if sig == signal.SIGKILL:
        assert "exited with code -9" in message, message
    else:
        assert "did not load weights version 2 within 3 s" in message or "/health unanswered" in message, message


def pipeline_worker(rank: int, results, port: int):
    """Rank 0 sends the same tensors pipelined (version 1), then unpipelined (version 0), logging when it flattens
    each bucket and when it waits for each bucket's data; rank 1 receives both."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    tensors = [(f"t{i}.{dtype}", (torch.randn(97 + 31 * i, generator=gen) * 100).to(dtype))
               for i in range(6) for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32)]
    init = f"tcp://127.0.0.1:{port}"
    try:
        if rank == 1:
            with DistReceiver(init, 2, rank, timeout_s=30) as receiver:
                got = dict((version, digest(received.items())) for version, received in
                           (receiver.receive() for _ in range(2)))
            results.put((1, got))
            return
        with DistSender(init, 2, timeout_s=30, bucket_bytes=512) as sender:
            events, flatten, land, start = [], weights_dist.flatten, sender._land, sender._start_broadcast

            def logged_flatten(bucket, meta, device):
                events.append(("flatten", meta.index))
                return flatten(bucket, meta, device)

            def logged_land(in_flight, keep=0):
                events.extend(("land", index) for _, _, index in in_flight[:max(len(in_flight) - keep, 0)])
                land(in_flight, keep)

            def logged_start(tensor_N, group, what, bucket):
                events.append(("start", bucket))
                return start(tensor_N, group, what, bucket)

            weights_dist.flatten, sender._land, sender._start_broadcast = logged_flatten, logged_land, logged_start
            logs, stats = {}, {}
            for pipeline in (True, False):
                sender.pipeline = pipeline
                stats[pipeline] = sender.send(tensors, version=int(pipeline))
                logs[pipeline], events[:] = list(events), []
        results.put((0, {"digest": digest(tensors), "logs": logs, "stats": stats}))
    except BaseException as e:
        results.put((rank, {"error": f"{type(e).__name__}: {e}"}))


def test_pipelined_sender_delivers_exactly_what_the_unpipelined_one_does():
    out = run_pair(pipeline_worker, free_port())
    assert "error" not in out[0] and "error" not in out[1], out
    pipelined, unpipelined = out[1][1], out[1][0]
    assert pipelined == unpipelined == out[0]["digest"]  # bit-equal, every dtype
    stats = out[0]["stats"]
    assert stats[True].num_buckets == stats[False].num_buckets >= 12
    assert stats[True].num_bytes == stats[False].num_bytes

    # pipelined: bucket i+1 is flattened and its broadcast queued while bucket i's data is in flight, and bucket
    # i+2 is flattened only once bucket i landed (two flat buckets at most); unpipelined: one bucket at a time
    logs = out[0]["logs"]
    landed = [i for kind, i in logs[True] if kind == "land"]
    assert landed == list(range(stats[True].num_buckets))
    for i in landed[:-1]:
        assert logs[True].index(("start", i + 1)) < logs[True].index(("land", i))
        assert logs[False].index(("flatten", i + 1)) > logs[False].index(("land", i))
    for i in landed[:-2]:
        assert logs[True].index(("flatten", i + 2)) > logs[True].index(("land", i))


def test_ipc_handoff_of_bad_weights_is_an_error_naming_them_and_the_engine_keeps_its_own():
    cfg = RunConfig.load(None, ["placement=separate", "weight_transport=ipc", "weight_sync_timeout_s=30"])
    placement = place(cfg)
    model = build_model("tiny", seed=1)

    async def go():
        await placement.start(model.named_parameters(), 1)
        bad = [(n, p[:-1] if n == "model.norm.weight" else p) for n, p in model.named_parameters()]
        with pytest.raises(ValueError, match=r"refused weights version 2: ValueError: .*model\.norm\.weight"):
            await placement.push(bad, 2)
        stats = await placement.engine.get_stats()
        out = await placement.engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
        await placement.disconnect()
        return stats.weight_version, placement.engine.weight_version, len(out.output_ids)

    try:
        assert asyncio.run(go()) == (1, 1, 4)  # still version 1 on both sides, and generating
    finally:
        placement.shutdown()


def test_colocated_push_of_bad_weights_is_refused_at_once_and_the_next_push_loads():
    """The in-process receiver hears of the abort (it does not wait out its timeout), the engine keeps its weights,
    and the next push goes through the same transport."""
    placement = place(RunConfig.load(None, ["weight_sync_timeout_s=10"]))
    model = build_model("tiny", seed=1)

    async def go():
        first = await placement.start(model.named_parameters(), 1)
        assert gc.get_freeze_count() > 0  # what was built is left out of the collector's later passes
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="given twice"):
            await placement.push([*model.named_parameters(), ("model.norm.weight", model.model.norm.weight)], 2)
        refused_s, kept = time.monotonic() - t0, (await placement.engine.get_stats()).weight_version
        second = await placement.push(model.named_parameters(), 3)
        return first, refused_s, kept, second, (await placement.engine.get_stats()).weight_version

    try:
        first, refused_s, kept, second, version = asyncio.run(go())
    finally:
        placement.shutdown()
    assert gc.get_freeze_count() == 0
    assert first.reply.weight_version == 1 and kept == 1 and refused_s < 5
    assert second.reply.weight_version == version == 3 and second.reply.num_tensors == len(list(model.parameters()))
    assert second.num_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert 0 < second.transfer_s < second.sync_s and 0 < second.pause_s < second.sync_s


def test_colocated_push_to_an_engine_that_does_not_load_fails_within_the_timeout_and_no_late_load_reads():
    """The engine's thread never takes the load (stuck in a step): the push fails naming it within
    weight_sync_timeout_s, and the handover is closed, so the load, should it run later, reads nothing."""
    placement = place(RunConfig.load(None, ["weight_sync_timeout_s=1"]))
    model = build_model("tiny", seed=1)
    late = {}

    def stuck(named, version, pause_mode):
        late["handover"] = named
        return concurrent.futures.Future()  # never applied

    async def go():
        await placement.start(model.named_parameters(), 1)
        placement.engine.load_soon = stuck
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="did not load weights version 2 within timeout_s=1") as failed:
            await placement.push(model.named_parameters(), 2)
        return time.monotonic() - t0, failed.value.ranks

    try:
        elapsed, ranks = asyncio.run(go())
    finally:
        placement.shutdown()
    assert elapsed < 3 and ranks == (1,)
    with pytest.raises(ValueError, match="released before this load read it"):
        with late["handover"].reading(torch.device("cpu")):
            pass


def test_the_engine_client_imports_no_torch():
    """The client reads sync replies (`tandem.transport.sync`) without pulling torch into a process that only
    talks to an engine."""
    code = "import sys, tandem.engine.client; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_engine_benchmarks_import_without_the_http_packages():
    """The GPU machine lacks FastAPI, pydantic and aiohttp: the benchmarks that time an engine in process (and
    `frozen_heap`, which they time under) must not need them."""
    code = ("import sys; sys.modules.update(dict.fromkeys(['fastapi', 'pydantic', 'pydantic_core', 'starlette', "
            "'uvicorn', 'aiohttp'])); sys.path.insert(0, 'benchmarks'); "
            "import engine_throughput, moe_throughput, host_tier, jit_variants")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


async def generate_greedy(engine) -> list[list[int]]:
    """A few short greedy generations, one at a time (the same batch shapes in every engine)."""
    greedy = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    return [(await engine.generate([3 + i, 17, 5 * i % 400 + 2, 9], greedy)).output_ids for i in range(8)]


def assert_pushed_versions_generate_as_fresh_engines(placement, pushed) -> None:
    """Run `pushed` (pushes of versions 1 and 2 of `build_model("tiny", seed=version)` on CUDA, `generate_greedy`
    of the placement's engine after each, the outputs returned) and shut the placement down: the engine ended on
    version 2, and each output is what a fresh engine on that version's weights generates."""
    from tandem.config import EngineConfig
    from tandem.engine.engine import Engine

    try:
        outputs = asyncio.run(pushed())
        assert placement.engine.weight_version == 2
    finally:
        placement.shutdown()
    for version, output in zip((1, 2), outputs, strict=True):
        with Engine(build_model("tiny", seed=version).to("cuda"), EngineConfig(device="cuda", num_pages=512)) as fresh:
            assert asyncio.run(generate_greedy(fresh)) == output, version


@pytest.mark.gpu
def test_colocated_engine_on_its_stream_generates_as_a_fresh_engine_on_each_pushed_version():
    """The engine on a stream of its own, the weights by reference: after each push (the trainer changing its
    tensors at once, on its own stream) the engine generates exactly what a fresh engine on those weights does."""
    config = ["placement=colocated", "engine.device=cuda:0", "engine.num_pages=512", "weight_sync_timeout_s=30"]
    placement = place(RunConfig.load(None, config))

    async def pushed():
        outputs = []
        for version in (1, 2):
            trainer = build_model("tiny", seed=version).to("cuda")
            await placement.push(trainer.named_parameters(), version)
            with torch.no_grad():
                torch._foreach_add_(list(trainer.parameters()), 0.5)  # the trainer's next step, at once
            outputs.append(await generate_greedy(placement.engine))
        return outputs

    assert_pushed_versions_generate_as_fresh_engines(placement, pushed)


def test_frozen_heap_leaves_the_heap_out_while_it_lasts_and_collects_what_was_built_within():
    """`frozen_heap` (a benchmark's configurations, one engine after another): what exists at entry is frozen, no
    longer after exit, so a cycle built and dropped within (as a closed engine's objects) goes at the next pass."""
    class Node:
        pass

    with frozen_heap():
        assert gc.get_freeze_count() > 0
        node = Node()
        node.self = node  # (a cycle: only a pass of the collector frees it)
        gone = weakref.ref(node)
        del node
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None
