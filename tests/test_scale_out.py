"""Engine replicas (issue 22): two engine processes behind the router, one weight broadcast to both, one of them
SIGKILLed mid-run and restarted; and the protections one by one: a replica joins the router only with the others'
weights, no replica loads before every one holds the transfer, a token older than its episode's start is caught."""

import asyncio
import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from test_transport import free_port

from tandem.config import EngineConfig, RandomAgentConfig, RolloutConfig, RunConfig
from tandem.engine.engine import Engine
from tandem.model.loader import build_model
from tandem.rollout.manager import RolloutManager
from tandem.rollout.random_agent import RandomAgentEnv
from tandem.run.loop import Run
from tandem.server.http import ServerThread
from tandem.server.router import RouterConfig, build_router_app
from tandem.transport.checksum import weights_checksum
from tandem.transport.dist import DistReceiver, DistSender
from tandem.transport.weights import TransportError
from tandem.types import FinishReason, GenerateOutput

REPLICAS = ["placement=separate", "rollout.num_engines=2", "rollout.restart_engines=true", "rollout.group_size=2",
            "rollout.batch_groups=2", "rollout.num_in_flight=8", "rollout.max_staleness=1",
            "random_agent.prompt_len_max=24", "random_agent.response_len_median=4", "random_agent.response_len_max=24",
            "random_agent.max_context=128", "random_agent.tool_latency_s=0.05", "weight_bucket_bytes=65536",
            "weight_sync_timeout_s=20", "engine_timeout_s=20", "checkpoint_every=0"]


def replica_run(tmp_path, *overrides) -> Run:
    return Run(RunConfig.load(None, [*REPLICAS, f"out_dir={tmp_path}", *overrides]))


def kill_one_replica_mid_run(run: Run, at_batch: int) -> dict:
    """Once batch `at_batch` is taken (so that the manager admits episodes again), pause replica 0 in place (what
    reaches it from then on waits there: a request cannot finish between the look and the kill), SIGKILL its
    process once it holds requests (episodes in flight on it), then wait until its replacement is in rotation."""
    placement, take, seen = run.placement, run.manager.next_batch, {}

    async def next_batch():
        batch = await take()
        if run.trainer.version == at_batch and not seen:
            victim, t0 = placement.members[0], time.monotonic()
            await victim.client.pause("in_place")
            while (stats := await victim.client.get_stats()).num_running + stats.num_queued == 0:
                assert time.monotonic() - t0 < 30, "replica 0 got no request"
                await asyncio.sleep(0.01)
            seen.update(pid=victim.handle.pid, url=victim.handle.url, t=time.monotonic())
            os.kill(victim.handle.pid, signal.SIGKILL)
            while placement.restarts < 1:
                assert time.monotonic() - seen["t"] < 120, placement.lost
                await asyncio.sleep(0.05)
        return batch

    run.manager.next_batch = next_batch
    return seen


def prepare_kill(run: Run) -> None:
    run.killed = kill_one_replica_mid_run(run, at_batch=2)


def outcome(run: Run, trained: list[tuple[int, list]]) -> dict:
    """What the run did, as plain data (computed in the trainer's process, before it shuts down)."""
    placement, manager = run.placement, run.manager
    view = httpx.get(f"{placement.router.url}/get_server_info", timeout=10).json()["router"]["servers"]
    return dict(
        history=run.history, restarts=placement.restarts, slots=[m.slot for m in placement.members],
        pids=[m.handle.pid for m in placement.members], urls=[m.handle.url for m in placement.members],
        killed=run.killed["pid"], lost=placement.lost, view=view, first_versions=placement.first_versions,
        trainer_checksum=weights_checksum((n, p.to(torch.float32)) for n, p in run.trainer.named_weights()),
        trained=[(version, g.index, g.start_version, min(v for e in g.episodes for v in e.versions if v >= 0))
                 for version, batch in trained for g in batch],
        admitted=manager.next_index, dropped=dict(manager.dropped), dropped_ids=sorted(manager._dropped_indices),
        unfinished=sorted(set(manager.buffer) | set(manager.in_flight) | set(manager._readmit) | manager._retrying))


def check_outcome(o: dict, steps: int) -> None:
    # the run finished; the dead replica left, a new one took its slot (a new process) and rejoined
    assert [(h["step"], h["version"]) for h in o["history"]] == [(s, s) for s in range(1, steps + 1)]
    assert o["restarts"] == 1 and o["slots"] == [0, 1] and o["killed"] not in o["pids"], o
    assert len(o["lost"]) == 1 and "replica 0" in o["lost"][0], o["lost"]
    assert [s["url"] for s in o["view"]] == [o["urls"][1], o["urls"][0]]

    # every replica held the same weights after every update (checksums), and they are the trainer's
    for h in o["history"]:
        assert len(set(h["replica_checksums"].values())) == 1 and len(h["replica_checksums"]) == 2, h
    assert o["history"][-1]["replica_checksums"][0] == o["trainer_checksum"]

    # the restarted replica got traffic only with the current weights: its first tokens carry that version
    first = next(s for s in o["view"] if s["url"] == o["urls"][0])
    assert first["weight_version"] == o["first_versions"][o["urls"][0]] >= 2
    assert first["first_token_version"] >= first["weight_version"], first

    # every admitted group: trained once, or dropped with its reason, or still unfinished when the run stopped;
    # the groups the kill cut short ran again (counted), and the staleness bound held for every trained token
    ids = [index for _, index, _, _ in o["trained"]]
    assert len(ids) == len(set(ids)), ids
    assert set(range(o["admitted"])) == set(ids) | set(o["dropped_ids"]) | set(o["unfinished"])
    assert not set(ids) & (set(o["dropped_ids"]) | set(o["unfinished"]))
    assert o["dropped"] == {} and o["history"][-1]["rerun_groups"] >= 1, (o["dropped"], o["history"][-1])
    for version, index, start_version, oldest in o["trained"]:
        assert oldest >= max(start_version, version - 1), (version, index, start_version, oldest)


@pytest.mark.slow
def test_a_replica_killed_mid_run_is_replaced_and_no_group_is_lost_or_trained_twice(tmp_path):
    run = replica_run(tmp_path, "steps=5")
    trained: list[tuple[int, list]] = []
    run.on_batch = lambda version, batch: trained.append((version, batch))
    prepare_kill(run)
    try:
        asyncio.run(run.train())
        o = outcome(run, trained)
    finally:
        run.shutdown()
    assert "exited with code -9" in o["lost"][0]
    check_outcome(o, steps=5)


@pytest.mark.slow
def test_a_frozen_replica_fails_the_update_naming_it_and_the_others_go_on_without_it(tmp_path):
    """SIGSTOP (alive, silent): the update's collective times out naming the replica's rank; the replica is retired
    (killed), the group rebuilt with the other one, the update and the run go on; its groups run again."""
    run = replica_run(tmp_path, "steps=4", "rollout.restart_engines=false", "weight_sync_timeout_s=3",
                      "engine_timeout_s=30")
    frozen = {}

    def freeze(version, batch):  # after batch 2 is taken: the update to version 3 finds replica 0 silent
        if version == 2 and not frozen:
            victim = run.placement.members[0].handle
            frozen.update(pid=victim.pid, url=victim.url)
            os.kill(victim.pid, signal.SIGSTOP)

    run.on_batch = freeze
    try:
        history = asyncio.run(run.train())
    finally:
        if frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen["pid"], signal.SIGCONT)
        run.shutdown()
    placement = run.placement
    assert [(h["step"], h["version"]) for h in history] == [(s, s) for s in range(1, 5)]
    assert [m.slot for m in placement.members] == [1] and len(placement.lost) == 1, placement.lost
    assert "replica 0" in placement.lost[0] and "failed the update to version 3" in placement.lost[0]
    assert f"rank 1 (engine pid {frozen['pid']} at {frozen['url']}) did not" in placement.lost[0], placement.lost
    assert run.manager.dropped == {} and history[-1]["replicas"] == [1]


@pytest.fixture(scope="module")
def engines():
    config = EngineConfig(max_batch_requests=4)
    with Engine("tiny", config) as a, Engine("tiny", config) as b:
        yield a, b


def test_the_router_admits_a_replica_only_with_the_weights_of_those_in_rotation(engines):
    """The protection against a restarted replica taking traffic before it holds the current weights (the
    placement admits it after the update; this catches one admitted before)."""
    behind, current = engines
    weights = list(build_model("tiny", seed=3).named_parameters())
    asyncio.run(current.load_paused(weights, 4, "abort"))
    with ServerThread(behind) as b, ServerThread(current) as c, \
            ServerThread(app=build_router_app(RouterConfig(servers=(c.url,)))) as router:
        refused = httpx.post(f"{router.url}/add_worker", params={"url": b.url}, timeout=10)
        assert refused.status_code == 400, refused.text
        assert f"{b.url} holds weights version 0, the servers in rotation [4]" in refused.text
        asyncio.run(behind.load_paused(weights, 4, "abort"))
        added = httpx.post(f"{router.url}/add_worker", params={"url": b.url, "weight_version": 4}, timeout=10)
        assert added.status_code == 200 and added.json()["weight_version"] == 4, added.text
        servers = httpx.get(f"{router.url}/get_server_info", timeout=10).json()["router"]["servers"]
        assert [s["url"] for s in servers] == [c.url, b.url]
        assert httpx.post(f"{router.url}/remove_worker", params={"url": c.url}, timeout=10).status_code == 200
        out = httpx.post(f"{router.url}/generate", timeout=30, json={
            "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}}).json()
        assert out["meta_info"]["weight_version"] == 4  # from the one left: b


def test_no_receiver_returns_the_transfer_before_the_commit_and_a_failed_commit_withdraws_it():
    """Replicas pause in the transfer's commit, once every one holds the weights; none may load before."""
    init, named = f"tcp://127.0.0.1:{free_port()}", [("a", torch.randn(100)), ("b", torch.randn(7, 3))]
    returned: list[int] = []

    def receive(receiver):
        try:
            version, tensors = receiver.receive()
            returned.append(version)
            return {n: tensors[n].clone() for n in tensors}
        finally:
            receiver.release()

    with ThreadPoolExecutor(4) as pool:
        joining = [pool.submit(DistReceiver, init, 3, rank, "gloo", 10) for rank in (1, 2)]
        with DistSender(init, 3, timeout_s=10, bucket_bytes=256) as sender:
            receivers = [j.result() for j in joining]
            got = [pool.submit(receive, r) for r in receivers]
            seen_in_commit = []
            sender.send(named, 1, commit=lambda: (time.sleep(0.2), seen_in_commit.append(list(returned))))
            assert all(torch.equal(g.result()["b"], named[1][1]) for g in got)
            assert seen_in_commit == [[]] and sorted(returned) == [1, 1]

            got = [pool.submit(receive, r) for r in receivers]
            with pytest.raises(RuntimeError, match="pause failed"):
                sender.send(named, 2, commit=lambda: (_ for _ in ()).throw(RuntimeError("pause failed")))
            for g in got:
                with pytest.raises(TransportError, match="rank 0 withdrew weights version 2 after sending them"):
                    g.result()
            got = [pool.submit(receive, r) for r in receivers]  # the group stays usable
            sender.send(named, 3)
            assert all(torch.equal(g.result()["a"], named[0][1]) for g in got)
        for r in receivers:
            r.close()


class _StaleClient:
    """An engine that samples under weights version 0 whatever the run's version (a replica behind)."""

    async def generate(self, input_ids, sampling=None, rid=None, **_):
        n = sampling.max_new_tokens
        return GenerateOutput(rid or "r", [5] * n, [-1.0] * n, [0] * n, FinishReason("length", n), len(input_ids), 0)


def test_a_token_older_than_its_episodes_start_drops_the_group_with_that_reason():
    cfg = RolloutConfig(group_size=2, batch_groups=1, num_in_flight=2, max_staleness=0)

    async def go():
        env = lambda seed, j: RandomAgentEnv(RandomAgentConfig(), 512, seed, j)
        manager = RolloutManager(_StaleClient(), env, cfg, 128, 0, version=lambda: 1)
        manager.fill()
        while manager.in_flight:
            await asyncio.sleep(0.01)
        return manager.dropped

    dropped = asyncio.run(go())
    assert list(dropped.values()) == [1] and "older than the episode's start version" in next(iter(dropped)), dropped
