"""`tandem router` in front of real servers (real tiny engines, real uvicorns on free ports, all in this process):
two replicas, or a prefill and two decode servers; httpx and the engine's own client as clients. Placement and the
prefill/decode request shaping also as functions."""

import asyncio
import dataclasses
import json
import random
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import wait_until

from tandem.cli import main as cli_main
from tandem.config import EngineConfig
from tandem.engine.client import EngineClient
from tandem.engine.engine import Engine
from tandem.server import upstream
from tandem.server.guard import ServerOptions
from tandem.server.http import ServerThread
from tandem.server.prefix_map import Backend, Pool, PrefixMap, page_keys
from tandem.server.router import Router, RouterConfig, build_router_app, with_bootstrap
from tandem.server.upstream import _keepalive_socket
from tandem.types import SamplingParams

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": 4000, "ignore_eos": True}  # seconds on CPU: "in flight" for a while
KEY, ADMIN_KEY = "router-key-123", "router-admin-456"
SERVER_KEY, SERVER_ADMIN_KEY = "server-key-789", "server-admin-012"


def router_thread(config: RouterConfig, options: ServerOptions | None = None) -> ServerThread:
    return ServerThread(app=build_router_app(config, options), options=options)




def stats(engine):
    return asyncio.run(engine.get_stats())


@pytest.fixture(scope="module")
def engines():
    with Engine("tiny", EngineConfig(page_size=16, max_batch_requests=4)) as a, \
            Engine("tiny", EngineConfig(page_size=16, max_batch_requests=4)) as b:
        yield a, b


@pytest.fixture(scope="module")
def servers(engines):
    with ServerThread(engines[0]) as a, ServerThread(engines[1]) as b:
        yield a, b


@pytest.fixture(scope="module")
def router(servers):
    with router_thread(RouterConfig(servers=(servers[0].url, servers[1].url))) as r:
        yield r


@pytest.fixture
def client(router):
    with httpx.Client(base_url=router.url, timeout=30) as c:
        yield c


def generate(client, input_ids, sampling=GREEDY, **fields):
    r = client.post("/generate", json={"input_ids": input_ids, "sampling_params": sampling, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def finished(engines):
    return [stats(e).num_finished for e in engines]


def test_every_turn_of_an_episode_goes_to_one_server_and_new_episodes_spread(engines, client):
    rng = random.Random(0)
    homes = []
    for _ in range(4):
        before = finished(engines)
        ids, previous = [rng.randrange(512) for _ in range(rng.randrange(20, 40))], []
        for turn in range(3):
            out = generate(client, ids)
            # the server holds the previous turn's prompt (and output) in its prefix cache
            assert out["meta_info"]["cached_tokens"] >= len(previous), (turn, out["meta_info"])
            previous = ids
            ids = ids + out["output_ids"] + [rng.randrange(512) for _ in range(10)]  # the tool's answer
        done = [n - m for n, m in zip(finished(engines), before, strict=True)]
        assert sorted(done) == [0, 3], done  # all three turns on one server
        homes.append(done.index(3))
    assert sorted(homes) == [0, 0, 1, 1], homes  # each new episode on the server that had taken fewer


def test_a_new_episode_goes_to_the_server_with_fewest_requests_in_flight(engines, router, client):
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(lambda: httpx.post(f"{router.url}/generate", timeout=30, json={
            "input_ids": [3, 4, 5], "sampling_params": LONG, "rid": "long-one"}).json())
        busy = wait_until(lambda: [i for i, e in enumerate(engines) if stats(e).num_running], 10)[0]
        before = finished(engines)
        for first in ([7, 8, 9], [10, 11, 12], [13, 14, 15]):
            generate(client, first)
        done = [n - m for n, m in zip(finished(engines), before, strict=True)]
        assert done[busy] == 0 and done[1 - busy] == 3, (busy, done)
        r = client.post("/abort_request", json={"rid": "long-one"})  # to every server; unknown rids are ignored
        assert r.status_code == 200, r.text
        assert long.result(timeout=10)["meta_info"]["finish_reason"]["type"] == "abort"


def test_greedy_outputs_single_and_batch_equal_a_direct_call(servers, client):
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13]]
    body = {"input_ids": prompts[0], "sampling_params": GREEDY, "return_logprob": True, "rid": "same-1"}
    direct = httpx.post(f"{servers[1].url}/generate", json=body, timeout=30).json()
    routed = generate(client, prompts[0], return_logprob=True, rid="same-2")
    assert routed["output_ids"] == direct["output_ids"] and routed["meta_info"]["id"] == "same-2"
    assert [lp for lp, _, _ in routed["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [lp for lp, _, _ in direct["meta_info"]["output_token_logprobs"]], abs=1e-5)

    direct = httpx.post(f"{servers[0].url}/generate", json={"input_ids": prompts, "sampling_params": GREEDY},
                        timeout=30).json()
    batch = generate(client, prompts, rid=["b0", "b1", "b2"])
    assert [o["output_ids"] for o in batch] == [o["output_ids"] for o in direct]
    assert [o["meta_info"]["id"] for o in batch] == ["b0", "b1", "b2"]


def test_a_bad_request_gets_the_servers_own_400(servers, client):
    for body in ({"input_ids": [1, 512]}, {"input_ids": [[1, 2], [3, -1]]}, {"input_ids": "abc"}, {}):
        direct = httpx.post(f"{servers[0].url}/generate", json=body, timeout=30)
        routed = client.post("/generate", json=body)
        assert routed.status_code == direct.status_code == 400 and routed.json() == direct.json(), routed.text
    r = client.post("/pause_generation", json={"mode": "sideways"})  # checked once, here: nothing is sent
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("mode:"), r.text


def test_pause_continue_and_flush_reach_every_server(engines, servers, client):
    r = client.post("/pause_generation", json={"mode": "abort"})
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    try:
        with ThreadPoolExecutor(2) as pool:
            late = [pool.submit(lambda s=s: httpx.post(f"{s.url}/generate", timeout=30, json={
                "input_ids": list(range(40, 80)), "sampling_params": GREEDY}).json()) for s in servers]
            wait_until(lambda: all(stats(e).num_paused == 1 for e in engines))  # held by each server's pause
            assert not any(f.done() for f in late)
            assert client.post("/continue_generation").status_code == 200
            assert all(f.result(timeout=10)["meta_info"]["finish_reason"]["type"] == "length" for f in late)
    finally:
        client.post("/continue_generation")
    assert all(stats(e).pages_cached > 0 for e in engines)
    r = client.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert all(stats(e).pages_cached == 0 for e in engines)


def test_a_fan_out_that_fails_on_one_server_names_it(engines, servers, client):
    a, b = servers
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(lambda: httpx.post(f"{a.url}/generate", timeout=30, json={
            "input_ids": [3, 4, 5], "sampling_params": LONG}).json())
        wait_until(lambda: stats(engines[0]).num_running)
        httpx.post(f"{a.url}/pause_generation", json={"mode": "in_place"})  # its request keeps its KV pages
        r = client.post("/flush_cache")
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and r.json()["success"] is False, r.text
        assert message.startswith(f"/flush_cache failed on 1 of 2 servers: server {a.url}: HTTP 400: flush_cache: "
                                  f"refused") and message.endswith(f"(it succeeded on {b.url})"), message
        httpx.post(f"{a.url}/pause_generation", json={"mode": "abort"})
        assert long.result(timeout=10)["meta_info"]["finish_reason"]["type"] == "abort"
        httpx.post(f"{a.url}/continue_generation")

    r = client.post("/update_weights_from_disk", json={"model_path": "/tmp"})  # neither server loads from disk
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message.startswith("/update_weights_from_disk failed on 2 of 2 servers: "), message
    assert f"server {a.url}: HTTP 400: model_path: " in message and f"; server {b.url}: HTTP 400: " in message
    assert "succeeded" not in message


def test_a_client_that_disconnects_has_its_request_aborted_on_the_server(engines, router):
    before = [stats(e).num_aborted for e in engines]
    with httpx.Client(base_url=router.url, timeout=httpx.Timeout(30, read=0.5)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/generate", json={"input_ids": [21, 22, 23], "sampling_params": LONG})
    # without the abort, the request would run to 4000 tokens and finish with "length"
    wait_until(lambda: sum(stats(e).num_aborted for e in engines) == sum(before) + 1)
    wait_until(lambda: all(stats(e).num_running == 0 for e in engines))


def test_the_engine_client_works_through_the_router(engines, router):
    engine_client = EngineClient(router.url, timeout_s=30).connect()
    assert engine_client.model_config.vocab_size == 512 and engine_client.max_context_len == 4096

    async def use():
        try:
            out = await engine_client.generate([5, 6, 7], SamplingParams(**GREEDY))
            assert await engine_client.health(5)
            return out, await engine_client.get_stats()
        finally:
            await engine_client.aclose()

    out, summed = asyncio.run(use())
    each = [stats(e) for e in engines]
    assert summed.num_finished == sum(s.num_finished for s in each)
    assert summed.pages_total == sum(s.pages_total for s in each)
    assert out.output_ids == asyncio.run(engines[0].generate([5, 6, 7], SamplingParams(**GREEDY))).output_ids


def test_weight_group_calls_are_refused(client):
    for path in ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group"):
        r = client.post(path, json={"group_name": "g"})
        assert r.status_code == 400 and "call each server directly" in r.json()["error"]["message"], r.text


def test_server_info_and_metrics_are_the_routers_view(servers, client):
    generate(client, [30, 31, 32])
    info = client.get("/get_server_info").json()
    assert info["page_size"] == 16 and info["router"]["mode"] == "replicas"
    assert [s["url"] for s in info["router"]["servers"]] == [s.url for s in servers]
    assert client.get("/get_model_info").json()["vocab_size"] == 512
    samples = [s for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples]
    routed = {s.labels["server"]: s.value for s in samples if s.name == "tandem:router_requests_total"}
    assert routed == {s["url"]: s["routed"] for s in info["router"]["servers"]} and sum(routed.values()) > 0
    assert {s.name for s in samples} >= {"tandem:router_in_flight", "tandem:router_errors_total"}


def test_keys_for_the_router_and_for_its_servers(engines):
    def call(router, path, key):
        body = {"input_ids": [1, 2], "sampling_params": GREEDY} if path == "/generate" else {}
        return httpx.post(f"{router.url}{path}", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {key}"} if key else {})

    server_keys = ServerOptions(api_key=SERVER_KEY, admin_api_key=SERVER_ADMIN_KEY)
    router_keys = ServerOptions(api_key=KEY, admin_api_key=ADMIN_KEY)
    with ServerThread(engines[0], options=server_keys) as server:
        full = RouterConfig(servers=(server.url,), backend_api_key=SERVER_KEY, backend_admin_api_key=SERVER_ADMIN_KEY)
        half = RouterConfig(servers=(server.url,), backend_api_key=SERVER_KEY)  # no admin key for the server
        with router_thread(full, router_keys) as r, router_thread(half, router_keys) as r_half:
            assert call(r, "/generate", None).status_code == 401
            assert call(r, "/generate", KEY).status_code == 200
            assert call(r, "/pause_generation", KEY).status_code == 403
            assert call(r, "/pause_generation", ADMIN_KEY).status_code == 200  # the server got its admin key
            assert call(r, "/continue_generation", ADMIN_KEY).status_code == 200
            assert call(r_half, "/generate", KEY).status_code == 200
            refused = call(r_half, "/pause_generation", ADMIN_KEY)
            assert refused.status_code == 502 and f"server {server.url}: HTTP 403" in refused.text, refused.text


def test_a_stopped_server_is_a_502_naming_it_then_passed_over_until_it_is_back(engines, servers):
    doomed = ServerThread(engines[1]).start()
    config = RouterConfig(servers=(doomed.url, servers[0].url), probe_interval_s=0.2)
    with router_thread(config) as r, httpx.Client(base_url=r.url, timeout=30) as client, \
            ThreadPoolExecutor(1) as pool:
        body = {"input_ids": list(range(100, 140)), "sampling_params": LONG}
        running = pool.submit(lambda: client.post("/generate", json=body))
        wait_until(lambda: stats(engines[1]).num_running)
        t0 = time.monotonic()
        doomed.stop()  # its in-flight request gets a few seconds, then is cancelled
        cut = running.result(timeout=10)
        assert cut.status_code == 502 and f"server {doomed.url}: POST /generate" in cut.text, cut.text
        assert time.monotonic() - t0 < 6

        t0 = time.monotonic()
        again = client.post("/generate", json={**body, "sampling_params": GREEDY})  # sticks to the same server
        assert again.status_code == 502, again.text
        error = again.json()["error"]
        assert error["type"] == "BadGateway" and error["message"].startswith(f"server {doomed.url}: POST /generate: ")
        health = client.get("/health")
        assert health.status_code == 503 and doomed.url in health.text and servers[0].url not in health.text
        assert time.monotonic() - t0 < 3

        # marked down: the episode's next turn moves to the other server (paying a prefill), as new episodes go
        before = stats(engines[0]).num_finished
        moved = generate(client, list(range(100, 150)), GREEDY)
        assert moved["meta_info"]["cached_tokens"] == 0 and stats(engines[0]).num_finished == before + 1
        assert router_metrics(client)[("tandem:router_server_up", doomed.url)] == 0
        view = client.get("/get_server_info").json()["router"]["servers"]  # answered by the server that is up
        assert [(s["url"], s["down"]) for s in view] == [(doomed.url, True), (servers[0].url, False)]

        with ServerThread(engines[1], port=doomed.port):  # back, on the same port: the probe finds it
            wait_until(lambda: router_metrics(client)[("tandem:router_server_up", doomed.url)] == 1)
            assert client.get("/health").status_code == 200
            view = client.get("/get_server_info").json()["router"]["servers"][0]
            assert {k: view[k] for k in ("url", "role", "in_flight", "routed", "errors", "down")} == {
                "url": doomed.url, "role": "unified", "in_flight": 0, "routed": 2, "errors": 2, "down": False}


def router_metrics(client) -> dict:
    families = text_string_to_metric_families(client.get("/metrics").text)
    return {(s.name, s.labels["server"]): s.value for f in families for s in f.samples}


def test_a_server_that_breaks_its_connection_mid_request_is_a_502_at_once():
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    def crash():  # reads a request, then goes without a word, as a killed server process's connections do
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(1 << 16)
            conn.close()

    threading.Thread(target=crash, daemon=True).start()
    try:
        with router_thread(RouterConfig(servers=(url,))) as r:
            t0 = time.monotonic()
            reply = httpx.post(f"{r.url}/generate", json={"input_ids": [1, 2, 3]}, timeout=30)
            assert reply.status_code == 502, reply.text
            assert reply.json()["error"]["message"].startswith(f"server {url}: POST /generate: "), reply.text
            assert time.monotonic() - t0 < 2
    finally:
        listener.close()


def test_connections_to_servers_probe_for_a_vanished_peer(servers, monkeypatch):
    """A generate's read has no timeout: a server whose host vanishes is found by TCP keepalive probes."""
    made = []
    monkeypatch.setattr(upstream, "_keepalive_socket", lambda info: made.append(_keepalive_socket(info)) or made[-1])

    async def call():
        up = upstream.Upstream(connect_timeout_s=5)
        await up.open()
        try:
            assert (await up.call(servers[0].url, "GET", "/health")).status == 200 and len(made) == 1
            assert made[0].getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1  # the pooled connection's
            if hasattr(socket, "TCP_KEEPIDLE"):
                assert made[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == upstream.KEEPALIVE_S[0]
        finally:
            await up.close()

    asyncio.run(call())


def test_prefill_decode_mode_sticks_episodes_to_a_decode_server_and_generates_what_one_engine_does():
    """One prefill server and two decode servers."""
    config = EngineConfig(page_size=16, max_batch_requests=4)
    with Engine("tiny", dataclasses.replace(config, role="prefill")) as prefill_engine, \
            Engine("tiny", dataclasses.replace(config, role="decode")) as e0, \
            Engine("tiny", dataclasses.replace(config, role="decode")) as e1, \
            ServerThread(prefill_engine) as p, ServerThread(e0) as d0, ServerThread(e1) as d1, \
            router_thread(RouterConfig(prefill=(p.url,), decode=(d0.url, d1.url))) as r, \
            httpx.Client(base_url=r.url, timeout=60) as client:
        engines = (e0, e1)
        all_engines = (*engines, prefill_engine)
        rng = random.Random(1)
        ids, previous = [rng.randrange(512) for _ in range(40)], []
        want = asyncio.run(engines[0].generate(ids, SamplingParams(**GREEDY))).output_ids
        before = finished(all_engines)
        for turn in range(3):
            out = generate(client, ids)
            assert turn or out["output_ids"] == want
            assert out["meta_info"]["cached_tokens"] >= len(previous), (turn, out["meta_info"])  # as prefill saw it
            previous, ids = ids, ids + out["output_ids"] + [rng.randrange(512) for _ in range(10)]
        generate(client, [rng.randrange(512) for _ in range(40)])  # a new episode
        done = [n - m for n, m in zip(finished(all_engines), before, strict=True)]
        assert sorted(done[:2]) == [1, 3] and done[2] == 4, done  # every prompt computed by the prefill server

        r = client.post("/flush_cache")  # reaches the prefill server too
        assert r.status_code == 200 and all(stats(e).pages_cached == 0 for e in all_engines), r.text


def test_the_router_command_serves_until_stopped(servers):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "tandem.cli", "router", "--server", servers[0].url, servers[1].url,
            "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            def healthy():
                try:
                    return client.get("/health").status_code == 200
                except httpx.TransportError:
                    assert proc.poll() is None, proc.communicate()[0].decode()[-2000:]
                    return False

            wait_until(healthy, 60)
            assert len(generate(client, [1, 2, 3])["output_ids"]) == GREEDY["max_new_tokens"]
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0].decode()
    assert f"routing to servers: {servers[0].url} {servers[1].url}" in out, out[-2000:]
    assert "Finished server process" in out, out[-2000:]  # shut down in order (uvicorn then re-raises SIGTERM)


# ---- placement and prefill/decode shaping, as functions -------------------------------------------------------
def test_prefix_map_finds_the_deepest_known_page_and_forgets_the_least_recently_used():
    keys = page_keys(list(range(50)), 16)
    assert len(keys) == 3 and keys[:2] == page_keys(list(range(40)), 16) and page_keys([1] * 15, 16) == []
    m = PrefixMap(capacity=4)
    m.record(keys[:2], 0)
    assert m.deepest(keys) == (2, 0) and m.deepest(page_keys([9] * 32, 16)) is None
    m.record(keys, 1)
    assert m.deepest(keys) == (3, 1)
    m.record(page_keys([9] * 32, 16), 0)
    assert len(m) == 4 and m.deepest(keys[:1]) is None  # keys[0] was the least recently used


def test_a_batch_goes_whole_to_the_server_of_its_deepest_known_prompt():
    pool = Pool([Backend("http://a:1", "unified"), Backend("http://b:1", "unified")], page_tokens=4)
    assert pool.choose([[1, 2, 3, 4, 5]]).url == "http://a:1"
    pool.backends[0].in_flight = 1
    assert pool.choose([[9] * 8]).url == "http://b:1"
    assert pool.choose([[1, 2, 3, 4, 5], [9] * 9]).url == "http://b:1"  # 2 pages known on b, 1 on a
    pool.backends[0].in_flight = 0
    assert pool.choose([[1, 2, 3, 4, 6]]).url == "http://b:1"  # the batch's prompts now map there


def test_prefill_decode_placement_sticks_both_servers_and_adds_the_bootstrap():
    p1, p2, d1, d2 = (f"http://127.0.0.1:{port}" for port in (1001, 1002, 2001, 2002))
    router = Router(RouterConfig(prefill=(p1, p2 + "/"), decode=(d1, d2)))
    episode = list(range(40))
    first = router.place(b'{"input_ids": %s, "rid": "t1"}' % str(episode).encode())
    assert (first.target.url, first.source.url, first.target.role) == (d1, p1, "decode")
    assert json.loads(first.body) == {
        "input_ids": episode, "rid": "t1", "bootstrap": {"prefill_url": p1}}
    first.target.in_flight += 1  # as a running generate holds it
    first.source.in_flight += 1
    later = router.place(b'{"input_ids": %s}' % str(episode + [7] * 20).encode())
    assert (later.target.url, later.source.url) == (d1, p1)
    other = router.place(b'{"input_ids": [5, 6, 7]}')
    assert (other.target.url, other.source.url) == (d2, p2)
    assert router.place(b"{not json").body == b"{not json"  # the decode server says what is wrong with it
    with pytest.raises(ValueError, match="bootstrap: the router sets it"):
        with_bootstrap({"input_ids": [1], "bootstrap": {"prefill_url": p2}}, p1)


@pytest.mark.parametrize("argv, message", [
    (["router"], "servers: give the replicas' URLs"),
    (["router", "--server", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"], "not both"),
    (["router", "--prefill", "http://127.0.0.1:1"], "prefill, decode: prefill/decode mode needs"),
    (["router", "--server", "127.0.0.1:1"], "is not a server's base URL"),
    (["router", "--server", "http://127.0.0.1:1", "http://127.0.0.1:1/"], "is named twice"),
    (["router", "--server", "http://127.0.0.1:1", "--host", "0.0.0.0"], "--host 0.0.0.0: binding beyond loopback"),
])
def test_router_command_line_mistakes_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_servers_stats_sum_as_one_engines():
    """Counters add up; the weight version is the lowest any server holds, the slowest iteration the longest."""
    from tandem.server.router import _sum_stats

    a = dict(num_steps=2, slow_iterations=1, slowest_iteration_seconds=0.3, weight_version=3, ideal_measured=True)
    b = dict(num_steps=3, slow_iterations=2, slowest_iteration_seconds=0.5, weight_version=5, ideal_measured=False)
    assert _sum_stats([a, b]) == dict(num_steps=5, slow_iterations=3, slowest_iteration_seconds=0.5, weight_version=3,
                                      ideal_measured=False)
