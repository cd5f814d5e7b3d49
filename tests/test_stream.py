"""Streaming on /generate (`stream: true`): SGLang's server-sent events, each chunk the output so far, the last one the
non-streamed result, `data: [DONE]` at the end; batches tag chunks with their index; a stop string ends a stream as
it ends a request; a client that goes away mid-stream has its request aborted and its pages freed."""

import asyncio
import time

import httpx
import pytest
from wire_helpers import events, model_dir_with_tokenizer

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.server.http import ServerThread
from tandem.server.router import build_router_app
from tandem.server.router_config import RouterConfig

PROMPT = [5, 6, 7, 8]
SEEDED = {"temperature": 1.0, "sampling_seed": 3, "max_new_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tokenizer = model_dir_with_tokenizer(path)
    with Engine(str(path), EngineConfig(page_size=16, max_batch_requests=4)) as engine, ServerThread(engine) as s:
        with httpx.Client(base_url=s.url, timeout=60) as client:
            client.server_url = s.url
            yield client, engine, tokenizer


def stream(client, body) -> list:
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return events(r)


def test_chunks_grow_to_the_non_streamed_result_of_a_seeded_request(served):
    client, engine, tokenizer = served
    body = {"input_ids": PROMPT, "sampling_params": SEEDED, "return_logprob": True}
    whole = client.post("/generate", json=body).json()
    chunks = stream(client, body)
    assert len(chunks) > 1 and all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    ids, text = [], ""
    for chunk in chunks:  # each chunk extends the one before: their increments concatenate to the result
        assert chunk["output_ids"][:len(ids)] == ids and len(chunk["output_ids"]) > len(ids)
        ids += chunk["output_ids"][len(ids):]
        assert chunk["text"].startswith(text) or chunk is chunks[-1]
        text = chunk["text"]
    last = chunks[-1]
    assert ids == whole["output_ids"] and last["text"] == whole["text"] == tokenizer.decode(ids)
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"] == {"type": "length",
                                                                                        "length": 16}
    # (the same logprobs, to the last bits a cached prompt's other computation path may change)
    streamed, direct = (list(zip(*m["meta_info"]["output_token_logprobs"], strict=True)) for m in (last, whole))
    assert streamed[1] == direct[1] and streamed[0] == pytest.approx(direct[0], abs=1e-5)


def test_a_batch_streams_chunks_tagged_with_their_index(served):
    client, *_ = served
    body = {"input_ids": [PROMPT, [9, 8, 7]], "sampling_params": SEEDED}
    whole = client.post("/generate", json=body).json()
    chunks = stream(client, body)
    for i in (0, 1):
        mine = [c for c in chunks if c["index"] == i]
        assert mine[-1]["output_ids"] == whole[i]["output_ids"] and mine[-1]["meta_info"]["finish_reason"]
    n = stream(client, {"input_ids": PROMPT, "sampling_params": {**SEEDED, "n": 2}})  # n samples: a batch
    assert {c["index"] for c in n} == {0, 1}


def test_a_stop_string_ends_the_stream(served):
    client, engine, tokenizer = served
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True, "skip_special_tokens": False}
    ids = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": greedy}).json()["output_ids"]
    k = next((k for k in range(2, len(ids) + 1) if len(now := tokenizer.decode(ids[:k])) >= 2
              and now[-2:] not in tokenizer.decode(ids[:k - 1]) and "\ufffd" not in now[-2:]), None)
    if k is None:
        pytest.skip("no output text to cut")
    stop = tokenizer.decode(ids[:k])[-2:]
    chunks = stream(client, {"input_ids": PROMPT, "sampling_params": {**greedy, "stop": stop}})
    assert chunks[-1]["output_ids"] == ids[:k] and chunks[-1]["meta_info"]["finish_reason"]["matched"] == stop
    assert all(stop not in c["text"] for c in chunks)


def test_an_error_before_streaming_is_a_400(served):
    client, *_ = served
    r = client.post("/generate", json={"input_ids": [1, 999], "stream": True})
    assert r.status_code == 400 and "input_ids[1]" in r.json()["error"]["message"]


def test_a_client_that_goes_away_mid_stream_has_its_request_aborted_and_pages_freed(served):
    client, engine, _ = served
    before = asyncio.run(engine.get_stats())
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 3000, "ignore_eos": True},
            "stream": True, "rid": "impatient"}
    with httpx.Client(base_url=str(client.base_url), timeout=60) as impatient:
        with impatient.stream("POST", "/generate", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # it runs: tokens arrive
    deadline = time.monotonic() + 20
    while (stats := asyncio.run(engine.get_stats())).num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats.num_running == 0 and stats.num_aborted == before.num_aborted + 1  # aborted, not run to its end
    assert stats.generated_tokens - before.generated_tokens < 3000
    cached = engine.cache.num_pages if engine.cache else 0
    assert stats.pages_free + cached == engine.pool.num_pages  # no page held by it
    again = {**body, "stream": False, "sampling_params": {"max_new_tokens": 2}}
    assert client.post("/generate", json=again).status_code == 200  # its rid is no longer in flight


def test_a_router_relays_the_stream_as_it_comes_and_a_client_gone_aborts_it(served):
    client, engine, _ = served
    body = {"input_ids": PROMPT, "sampling_params": SEEDED, "return_logprob": True}
    whole = client.post("/generate", json=body).json()
    with ServerThread(app=build_router_app(RouterConfig(servers=(client.server_url,)))) as router, \
            httpx.Client(base_url=router.url, timeout=60) as via_router:
        chunks = stream(via_router, body)
        assert len(chunks) > 1 and chunks[-1]["output_ids"] == whole["output_ids"]
        before = asyncio.run(engine.get_stats()).num_aborted
        long = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 3000,
                                                          "ignore_eos": True}, "stream": True}
        with via_router.stream("POST", "/generate", json=long) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: {"))
        deadline = time.monotonic() + 20
        while (stats := asyncio.run(engine.get_stats())).num_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats.num_running == 0 and stats.num_aborted == before + 1
        assert via_router.post("/generate", json={**body, "stream": True, "input_ids": [1, 999]}).status_code == 400
