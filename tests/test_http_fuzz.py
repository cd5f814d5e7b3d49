"""A fuzz of the HTTP endpoints: random JSON bodies (near-valid ones among them) never get a 500, never an engine
error inside a 200, and the engine serves an innocent request exactly as before afterwards."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.server.http import ServerThread

GREEDY = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}}
# the endpoints a fuzz may hit in any order: pausing and joining a group are left out (a paused engine holds every
# later generate; a join waits for peers), their bodies are checked field by field in test_server
ENDPOINTS = ["/generate", "/abort_request", "/flush_cache", "/continue_generation", "/update_weights_from_disk",
             "/update_weights_from_distributed", "/destroy_weights_update_group"]
FIELDS = ["input_ids", "sampling_params", "rid", "return_logprob", "stream", "logprob_start_len", "abort_all",
          "model_path", "weight_version", "group_name", "pause_mode", "flush_cache", "max_new_tokens", "temperature",
          "top_k", "top_p", "min_p", "seed", "stop_token_ids", "ignore_eos"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(0, 600),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.sampled_from(FIELDS), inner, max_size=4)), max_leaves=12)
bodies = st.one_of(st.dictionaries(st.sampled_from(FIELDS), values, max_size=5), values)
SAMPLING = ["max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop_token_ids", "ignore_eos"]
near_valid_generate = st.fixed_dictionaries(  # token ids the engine takes, sampling params of any value
    {"input_ids": st.lists(st.integers(0, 600), min_size=1, max_size=8),
     "sampling_params": st.dictionaries(st.sampled_from(SAMPLING), scalars, max_size=5)},
    optional={"return_logprob": st.booleans(), "rid": st.text(max_size=4)})
requests = st.one_of(st.tuples(st.sampled_from(ENDPOINTS), bodies),
                     st.tuples(st.just("/generate"), near_valid_generate))


@pytest.fixture(scope="module")
def server():
    with Engine("tiny", EngineConfig(page_size=16, max_batch_requests=4)) as engine, ServerThread(engine) as s:
        s.engine = engine
        yield s


def test_no_body_gets_a_500_or_an_engine_error_and_the_engine_serves_as_before(server):
    before = httpx.post(server.url + "/generate", json=GREEDY, timeout=60).json()["output_ids"]

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(requests)
    def fuzz(request):
        path, body = request
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code < 500, (path, body, r.text)
        if r.status_code == 200 and path == "/generate":
            if r.headers["content-type"].startswith("text/event-stream"):  # streamed: its chunks
                chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
                assert chunks and r.text.endswith("data: [DONE]\n\n") and all("error" not in c for c in chunks), r.text
                replies = [c for c in chunks if c["meta_info"]["finish_reason"] is not None]
            else:
                replies = r.json() if isinstance(r.json(), list) else [r.json()]
            for out in replies:
                reason = out["meta_info"]["finish_reason"]
                assert "engine error" not in str(reason.get("message", "")), (body, reason)

    fuzz()
    httpx.post(server.url + "/continue_generation", timeout=60)
    assert httpx.post(server.url + "/generate", json=GREEDY, timeout=60).json()["output_ids"] == before
    assert server.engine.is_alive()
