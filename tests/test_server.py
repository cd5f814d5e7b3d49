"""The HTTP server: a real uvicorn on a free port in a background thread, a real tiny engine, httpx as client."""

import asyncio
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from tandem.config import EngineConfig
from tandem.engine.client import IDLE_CLOSE_S, EngineClient, EngineUnreachable
from tandem.engine.engine import Engine
from tandem.server.guard import ServerOptions
from tandem.server.http import KEEP_ALIVE_S, ServerThread
from tandem.transport.dist import DistSender
from tandem.types import SamplingParams

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}  # seconds on CPU: "in flight" for a while


@pytest.fixture(scope="module")
def engine():
    with Engine("tiny", EngineConfig(page_size=16, max_batch_requests=4)) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    with ServerThread(engine, options=ServerOptions(weight_dirs=(str(tmp_path_factory.getbasetemp()),))) as s:
        yield s


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c
        # leave the engine serving whatever a failed test did
        c.post("/continue_generation")


def stats(engine):
    return asyncio.run(engine.get_stats())


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"condition not met within {timeout} s")


def post_in_background(pool, server, body):
    """POST /generate from another thread (its own connection); returns a future of the JSON reply."""
    return pool.submit(lambda: httpx.post(f"{server.url}/generate", json=body, timeout=30).json())


def wait_running(engine, n=1):
    wait_until(lambda: (s := stats(engine)).num_running >= n and s.generated_tokens > 0)


def post(client, path, body):
    """POST `body`: JSON-encoded, or bytes as they are."""
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json"})
    return client.post(path, json=body)


def ok(client, prompt=(5, 6, 7)):
    r = client.post("/generate", json={"input_ids": list(prompt), "sampling_params": {**GREEDY, "max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


def test_binds_localhost_and_reports_health_and_info(server, client):
    assert server.host == "127.0.0.1"
    assert client.get("/health").status_code == 200
    info = client.get("/get_model_info").json()
    assert info["vocab_size"] == 512 and info["is_generation"] is True and isinstance(info["weight_version"], int)
    assert info["context_length"] == 4096
    server_info = client.get("/get_server_info").json()
    assert server_info["max_batch_requests"] == 4 and server_info["page_size"] == 16


def test_single_and_batch_generate_equal_the_engine(engine, client):
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13]]
    direct = [asyncio.run(engine.generate(p, SamplingParams(**GREEDY))) for p in prompts]
    version = stats(engine).weight_version

    r = client.post("/generate", json={"input_ids": prompts[0], "sampling_params": GREEDY, "return_logprob": True,
                                       "rid": "single-1", "stream": False, "logprob_start_len": -1,
                                       "return_text_in_logprobs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_ids"] == direct[0].output_ids
    meta = body["meta_info"]
    assert meta["id"] == "single-1"
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (4, 8) and "cached_tokens" in meta
    assert meta["weight_version"] == version and meta["output_token_weight_versions"] == [version] * 8
    logprobs, ids, texts = zip(*meta["output_token_logprobs"], strict=True)
    assert list(ids) == direct[0].output_ids and set(texts) == {None}
    assert list(logprobs) == pytest.approx(direct[0].output_logprobs, abs=1e-5)

    r = client.post("/generate", json={"input_ids": prompts, "sampling_params": GREEDY, "rid": ["b0", "b1", "b2"]})
    assert r.status_code == 200, r.text
    batch = r.json()
    assert [o["output_ids"] for o in batch] == [d.output_ids for d in direct]
    assert [o["meta_info"]["id"] for o in batch] == ["b0", "b1", "b2"]
    assert "output_token_logprobs" not in batch[0]["meta_info"]

    per_element = [GREEDY, {**GREEDY, "max_new_tokens": 3}]
    r = client.post("/generate", json={"input_ids": prompts[:2], "sampling_params": per_element})
    assert [o["output_ids"] for o in r.json()] == [direct[0].output_ids, direct[1].output_ids[:3]]


def test_a_json_body_is_read_whatever_its_content_type(client):
    """`curl -d` labels its body form-urlencoded; none at all is fine too."""
    body = b'{"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}'
    for headers in ({"content-type": "application/x-www-form-urlencoded"}, {}):
        r = client.post("/generate", content=body, headers=headers)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2, r.text


BAD_GENERATE = [
    (b"{not json", "request body: malformed JSON"),
    ([1, 2], "request body: must be a JSON object"),
    ({}, "input_ids: required"),
    ({"input_ids": "abc"}, "input_ids: must be a non-empty list"),
    ({"input_ids": []}, "input_ids: must be a non-empty list"),
    ({"input_ids": [1, "a"]}, "input_ids[1]"),
    ({"input_ids": [1, 512]}, "input_ids[1]: 512 is not a token id"),
    ({"input_ids": [[1, 2], [3], [4, 5, 6, 7, 8, -1]]}, "input_ids[2][5]"),
    ({"input_ids": [[1, 2], []]}, "input_ids[1]: must be a non-empty list"),
    ({"input_ids": [[1]] * 5}, "max_batch_requests"),
    ({"input_ids": [1], "sampling_params": [1]}, "sampling_params: must be an object"),
    ({"input_ids": [1], "sampling_params": [{}]}, "sampling_params: must be an object"),  # a list is for a batch
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"max_tokens": 5}}, "max_tokens"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [9999]}}, "sampling_params.stop_token_ids"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}, {"top_p": 0}]}, "sampling_params[1].top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}}, "max_new_tokens (5000) exceeds the context"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [1], "rid": 5}, "rid: must be a non-empty string"),
    ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "rid: 'a' appears more than once"),
    ({"input_ids": [[1], [2]], "rid": "a"}, "rid: a batch of 2 requests needs a list"),
    ({"input_ids": [1], "stream": "yes"}, "stream: must be a valid boolean"),
    ({"input_ids": [1], "logprob_start_len": 0}, "logprob_start_len"),
    ({"input_ids": [1], "return_text_in_logprobs": 1}, "return_text_in_logprobs: must be a valid boolean, got 1"),
    ({"text": "hello"}, "text: this model directory has no tokenizer"),
    ({"input_ids": [1], "sampling_params": {"stop": "x"}}, "sampling_params.stop: stop strings need a tokenizer"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "sampling_params.frequency_penalty: tandem"),
    ({"input_ids": [1], "sampling_params": {"n": 5}}, "max_batch_requests"),
    ({"input_ids": [1], "image_data": "x.png"}, "image_data: tandem has no multimodal input"),
    ({"input_ids": [1], "return_logprobs": True}, "return_logprobs: unknown field"),
    ({"input_ids": [1], "temperature": 0}, "temperature: unknown field"),
]


@pytest.mark.parametrize("body, message", BAD_GENERATE, ids=[m for _, m in BAD_GENERATE])
def test_bad_generate_is_a_400_naming_the_field_and_submits_nothing(engine, client, body, message):
    before = stats(engine).num_finished
    r = post(client, "/generate", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequest" and message in error["message"], error
    assert stats(engine).num_finished == before  # no element of a bad batch reached the engine
    ok(client)


BAD_CONTROL = [
    ("/pause_generation", {"mode": "nap"}, "mode: must be 'abort', 'retract' or 'in_place', got 'nap'"),
    *[("/pause_generation", {"mode": mode}, f"mode: must be 'abort', 'retract' or 'in_place', got {mode!r}")
      for mode in (0, False, "", None)],  # none of them means SGLang's default: only a missing mode does
    ("/pause_generation", {"mode": "abort", "timeout": 3}, "timeout: unknown field"),
    ("/abort_request", {}, "rid: must be a non-empty string"),
    ("/abort_request", {"abort_all": "yes"}, "abort_all: must be a valid boolean"),
    ("/flush_cache", {"all": True}, "all: unknown field"),
    ("/update_weights_from_disk", {}, "model_path: required"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent", "weight_version": "v2"}, "weight_version"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent", "weight_version": "7"},  # JSON types are strict
     "weight_version: must be a valid integer, got '7'"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent"}, "model_path: '/nonexistent' is outside the "
                                                                  "directories this server loads weights from"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2,
                                    "backend": "gloo"}, "master_port: required"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 2}, "backend: nccl needs the engine on a CUDA device"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0,
                                    "world_size": 2, "backend": "gloo"}, "rank: rank 0 is the sender"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 2, "backend": "gloo", "timeout_s": 0}, "timeout_s: must be greater"),
    ("/init_weights_update_group", b'{"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, '
                                   b'"world_size": 2, "backend": "gloo", "timeout_s": Infinity}',
     "timeout_s: must be a finite number"),
    ("/init_weights_update_group", {"master_address": "", "master_port": 1, "rank_offset": 1, "world_size": 2,
                                    "backend": "gloo"}, "master_address: must be the trainer's host name"),
    ("/update_weights_from_distributed", {"group_name": "g"}, "group_name: no weight group 'g'"),
    ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]},
     "names: tandem's sender puts"),
    ("/update_weights_from_distributed", {"pause_mode": "nap"}, "pause_mode: must be 'abort', 'retract' or"),
    ("/update_weights_from_distributed", {"flush_cache": False}, "flush_cache: the engine's prefix_cache_max_age"),
    ("/update_weights_from_distributed", {"weight_version": True}, "weight_version: must be a valid integer"),
    ("/destroy_weights_update_group", {"group_name": "g"}, "group_name: no weight group 'g'"),
]


@pytest.mark.parametrize("path, body, message", BAD_CONTROL, ids=[m for _, _, m in BAD_CONTROL])
def test_bad_control_request_is_a_400_naming_the_field(client, path, body, message):
    r = post(client, path, body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    ok(client)


def test_unexpected_exception_is_a_500_and_the_server_keeps_serving(engine, client, monkeypatch):
    async def broken():
        raise RuntimeError("stats exploded")

    monkeypatch.setattr(engine, "get_stats", broken)
    r = client.get("/metrics")
    assert r.status_code == 500 and "stats exploded" in r.json()["error"]["message"]
    monkeypatch.undo()
    assert client.get("/metrics").status_code == 200
    ok(client)


def test_pause_abort_then_continue(engine, server, client):
    with ThreadPoolExecutor(2) as pool:
        long = post_in_background(pool, server, {"input_ids": [3, 4, 5], "sampling_params": LONG})
        wait_running(engine)
        assert client.post("/pause_generation", json={}).json()["status"] == "ok"  # no mode: SGLang's abort
        out = long.result(timeout=10)
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < out["meta_info"]["completion_tokens"] < 2000

        late = post_in_background(pool, server, {"input_ids": [6, 7], "sampling_params": GREEDY})
        time.sleep(0.2)
        assert not late.done()  # queued while paused
        assert client.post("/continue_generation").status_code == 200
        assert late.result(timeout=10)["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_request_by_rid_and_abort_all(engine, server, client):
    with ThreadPoolExecutor(2) as pool:
        a = post_in_background(pool, server, {"input_ids": [3, 4], "sampling_params": LONG, "rid": "abort-me"})
        b = post_in_background(pool, server, {"input_ids": [5, 6], "sampling_params": LONG, "rid": "abort-all"})
        wait_running(engine, 2)
        assert client.post("/abort_request", json={"rid": "abort-me"}).status_code == 200
        assert a.result(timeout=10)["meta_info"]["finish_reason"]["type"] == "abort"
        assert not b.done()
        assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
        assert b.result(timeout=10)["meta_info"]["finish_reason"]["type"] == "abort"


def test_flush_cache_refused_while_a_request_holds_pages_allowed_when_idle(engine, server, client):
    with ThreadPoolExecutor(1) as pool:
        long = post_in_background(pool, server, {"input_ids": [3, 4, 5], "sampling_params": LONG})
        wait_running(engine)
        client.post("/pause_generation", json={"mode": "in_place"})
        r = client.post("/flush_cache")
        assert r.status_code == 400 and "flush_cache: refused" in r.json()["error"]["message"]
        client.post("/pause_generation", json={"mode": "abort"})  # releases the frozen request
        assert long.result(timeout=10)["meta_info"]["finish_reason"]["type"] == "abort"
    assert client.post("/flush_cache").json()["success"] is True
    s = stats(engine)
    assert s.pages_cached == 0 and s.pages_free == s.pages_total
    client.post("/continue_generation")


def test_update_weights_from_disk(engine, client, tmp_path):
    prompt = {"input_ids": [3, 4, 5, 6, 7], "sampling_params": GREEDY}
    before = client.post("/generate", json=prompt).json()
    gen = torch.Generator().manual_seed(0)
    perturbed = {name: (p.detach() + 0.05 * torch.randn(p.shape, generator=gen)).contiguous()
                 for name, p in engine.model.named_parameters()}
    (tmp_path / "good").mkdir()
    save_file(perturbed, tmp_path / "good" / "model.safetensors")
    (tmp_path / "bad").mkdir()
    save_file({"model.norm.weight": torch.ones(3)}, tmp_path / "bad" / "model.safetensors")
    good = {"model_path": str(tmp_path / "good"), "weight_version": 7}

    r = client.post("/update_weights_from_disk", json=good)
    assert r.status_code == 400 and "must be paused" in r.json()["message"]
    client.post("/pause_generation", json={"mode": "abort"})
    r = client.post("/update_weights_from_disk", json=good)
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and r.json()["weight_version"] == 7

    r = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "bad"), "weight_version": 8})
    assert r.status_code == 400 and r.json()["success"] is False
    assert "model.norm.weight has shape (3,)" in r.json()["error"]["message"]
    assert client.get("/get_model_info").json()["weight_version"] == 7
    client.post("/continue_generation")

    after = client.post("/generate", json=prompt).json()
    assert after["meta_info"]["weight_version"] == 7
    assert after["meta_info"]["output_token_weight_versions"] == [7] * 8
    assert after["output_ids"] != before["output_ids"]


def test_weights_arrive_while_generating_and_only_the_load_pauses(engine, server, client):
    """/update_weights_from_distributed: while the engine waits for (and receives) the buckets it keeps generating
    and is not paused; it pauses only to load them. The trainer (a DistSender in a thread here) sends late on
    purpose, so the receive visibly overlaps generation."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    version = stats(engine).weight_version + 1
    weights = {name: p.detach().clone() for name, p in engine.model.named_parameters()}  # the same weights
    with ThreadPoolExecutor(3) as pool:
        joining = pool.submit(DistSender, f"tcp://127.0.0.1:{port}", 2, timeout_s=30, bucket_bytes=64 << 10)
        r = client.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo",
            "group_name": "w", "timeout_s": 30})
        assert r.status_code == 200 and r.json()["success"], r.text
        with joining.result(timeout=30) as sender:
            long = post_in_background(pool, server, {"input_ids": [3, 4, 5], "sampling_params": LONG})
            wait_running(engine)
            update = pool.submit(lambda: httpx.post(f"{server.url}/update_weights_from_distributed", timeout=60,
                                                    json={"group_name": "w", "weight_version": version}).json())
            before = stats(engine)
            time.sleep(0.8)  # (the update's request may reach the server late under load: transfer_s must pass 0.4)
            during = stats(engine)
            assert not update.done() and during.num_paused == 0
            assert during.generated_tokens > before.generated_tokens  # generating while the receiver waits
            sender.send(weights.items(), version)
            reply = update.result(timeout=30)
            assert client.post("/destroy_weights_update_group", json={"group_name": "w"}).json()["success"]
        assert reply["success"] and reply["weight_version"] == version == stats(engine).weight_version
        assert reply["transfer_s"] > 0.4 > reply["load_s"] >= reply["pause_s"] > 0 and reply["num_buckets"] >= 3
        after = stats(engine)
        assert after.num_paused == 0 and after.num_running == 1  # resumed (pause mode retract: recomputing)
        client.post("/abort_request", json={"abort_all": True})
        versions = long.result(timeout=10)["meta_info"]["output_token_weight_versions"]
        assert versions[0] == version - 1 and versions[-1] == version


def test_the_servers_connections_send_without_nagle_delay(server, client):
    """Replies with a body are written in two parts (headers, body); with Nagle's algorithm on, the body waits for
    the client's delayed ACK (about 40 ms on Linux) on every call. Every connection the server accepted must have
    TCP_NODELAY."""
    ok(client)  # the client's connection is open and kept alive
    connections = server._server.server_state.connections
    sockets = [c.transport.get_extra_info("socket") for c in connections]
    assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)


def test_engine_client_speaks_to_the_server(engine, server):
    """The HTTP client the trainer uses for a separate engine: same outputs as the engine, its stats, clear errors."""
    client = EngineClient(server.url, timeout_s=30).connect()
    assert client.model_config == engine.model_config and client.max_context_len == engine.max_context_len
    direct = asyncio.run(engine.generate([3, 4, 5], SamplingParams(**GREEDY)))

    async def session():
        try:
            out = await client.generate([3, 4, 5], SamplingParams(**GREEDY), rid="client-1")
            return out, await client.get_stats(), await client.health(5)
        finally:
            await client.aclose()

    out, got, healthy = asyncio.run(session())
    assert (out.rid, out.output_ids, out.weight_versions) == ("client-1", direct.output_ids, direct.weight_versions)
    assert out.output_logprobs == pytest.approx(direct.output_logprobs, abs=1e-6)
    assert out.finish_reason == direct.finish_reason and out.prompt_tokens == 3
    assert got.generated_tokens >= 16 and got.weight_version == stats(engine).weight_version and healthy
    async def refused():
        try:
            await client.generate([-1])
        finally:
            await client.aclose()

    with pytest.raises(ValueError, match=rf"engine at {server.url}: POST /generate: input_ids\[0\]"):
        asyncio.run(refused())
    with pytest.raises(EngineUnreachable, match="engine at http://127.0.0.1:1: GET /get_model_info: URLError"):
        EngineClient("http://127.0.0.1:1", timeout_s=5).connect()
    nobody = EngineClient("http://127.0.0.1:1", timeout_s=5)

    async def unanswered():
        try:
            await nobody.generate([3, 4, 5])
        finally:
            await nobody.aclose()

    with pytest.raises(EngineUnreachable, match="engine at http://127.0.0.1:1: POST /generate: ClientConnectorError"):
        asyncio.run(unanswered())


def test_cancelling_an_engine_client_generate_aborts_it_in_the_engine(engine, server):
    before = stats(engine)
    client = EngineClient(server.url, timeout_s=30).connect()

    async def cancel_one():
        try:
            task = asyncio.create_task(client.generate([3, 4, 5], SamplingParams(**LONG)))
            await asyncio.sleep(0.5)  # generating by now
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for _ in range(100):  # the client's connections stay open meanwhile: only the cancel can abort it
                if (s := await client.get_stats()).num_aborted > before.num_aborted and s.num_running == 0:
                    return s
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()

    s = asyncio.run(cancel_one())
    # without the abort, the request would run to 2000 tokens and finish with "length"
    assert s is not None and s.generated_tokens - before.generated_tokens < 2000


def scrape(client):
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {s.name: s.value for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_names_and_counts_move(engine, client):
    m0 = scrape(client)
    expected = {"tandem:num_running_reqs", "tandem:num_queue_reqs", "tandem:generation_tokens_total",
                "tandem:prefill_tokens_computed_total", "tandem:prefill_tokens_cached_total", "tandem:cache_hit_rate",
                "tandem:num_retractions_total", "tandem:kv_pages_free", "tandem:kv_pages_cached",
                "tandem:weight_version"}
    assert expected <= set(m0)
    prompt = list(range(100, 140))  # 40 tokens: two full pages to reuse
    for _ in range(2):
        client.post("/generate", json={"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 5}})
    m1 = scrape(client)
    assert m1["tandem:generation_tokens_total"] - m0["tandem:generation_tokens_total"] == 10
    assert m1["tandem:prefill_tokens_cached_total"] - m0["tandem:prefill_tokens_cached_total"] >= 32
    assert m1["tandem:prefill_tokens_computed_total"] > m0["tandem:prefill_tokens_computed_total"]
    assert m1["tandem:cache_hit_rate"] > 0 and m1["tandem:num_running_reqs"] == 0
    assert m1["tandem:kv_pages_free"] + m1["tandem:kv_pages_cached"] == m1["tandem:kv_pages_total"]
    assert m1["tandem:kv_pages_cached"] >= 2
    assert m1["tandem:weight_version"] == client.get("/get_model_info").json()["weight_version"]


@pytest.mark.parametrize("input_ids", [[3, 4, 5], [[3, 4, 5], [6, 7]]], ids=["single", "batch"])
def test_client_disconnect_aborts_and_frees_pages(engine, server, input_ids):
    before = stats(engine)
    n = len(input_ids) if isinstance(input_ids[0], list) else 1
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(30, read=0.5)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/generate", json={"input_ids": input_ids, "sampling_params": LONG})

    # without the abort, the requests would run to 2000 tokens and finish with "length"
    s = wait_until(lambda: (s := stats(engine)).num_aborted >= before.num_aborted + n and s)
    s = wait_until(lambda: (s := stats(engine)).num_running == 0 and s.num_queued == 0 and s)
    assert s.num_aborted == before.num_aborted + n
    assert s.generated_tokens - before.generated_tokens < n * 2000
    assert s.pages_free + s.pages_cached == s.pages_total


@pytest.mark.parametrize("idle_close_s, fails", [(0.5, False), (30.0, True)], ids=["client-closes-first", "race"])
def test_a_client_never_posts_on_a_connection_the_server_has_closed(engine, idle_close_s, fails):
    """A trainer's step blocks the event loop its client shares, so the server's close of an idle connection goes
    unseen; a POST then sent on it fails (aiohttp retries no POST), and its episodes would be counted unreachable.
    The client closes idle connections before the server would (`IDLE_CLOSE_S` below tandem's `KEEP_ALIVE_S` and
    uvicorn's default, which SGLang's servers run with); with the order reversed ("race") the POST fails."""
    import uvicorn

    assert min(KEEP_ALIVE_S, uvicorn.Config(app=None).timeout_keep_alive) > IDLE_CLOSE_S
    with ServerThread(engine, keep_alive_s=1.0) as server:
        client = EngineClient(server.url, timeout_s=30, idle_close_s=idle_close_s)

        async def after_a_busy_loop():
            try:
                await client.generate([3, 4, 5], SamplingParams(**GREEDY))
                time.sleep(1.6)  # the loop busy (a training step) while the server closes the idle connection
                return await client.generate([3, 4, 5], SamplingParams(**GREEDY))
            finally:
                await client.aclose()

        if fails:
            with pytest.raises(EngineUnreachable, match="ServerDisconnectedError"):
                asyncio.run(after_a_busy_loop())
        else:
            assert len(asyncio.run(after_a_busy_loop()).output_ids) > 0
