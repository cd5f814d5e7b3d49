"""The router in front of unified servers that speak chat: the OpenAI-compatible routes relayed (streams too), a
session's every turn on the server that holds its history, the sessions' counters summed."""

import httpx
import openai
import pytest
from chat_models import chat_model_dir
from test_router import router_thread

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.server.http import ServerThread
from tandem.server.router import RouterConfig

CHAT = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat")
    chat_model_dir(path)
    with Engine(str(path), EngineConfig(page_size=16)) as a, Engine(str(path), EngineConfig(page_size=16)) as b, \
            ServerThread(a) as sa, ServerThread(b) as sb, \
            router_thread(RouterConfig(servers=(sa.url, sb.url))) as router:
        yield router.url, (sa.url, sb.url)


def test_openai_client_through_the_router(setup):
    url, _ = setup
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    assert [m.id for m in client.models.list().data]
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], **CHAT)
    assert reply.choices[0].model_extra["token_ids"]
    streamed = client.completions.create(model="m", prompt="What is", stream=True, **CHAT)
    chunks = [chunk for chunk in streamed if chunk.choices]
    assert len(chunks) >= 2 and chunks[-1].choices[0].finish_reason is not None  # relayed chunk by chunk


def test_a_sessions_turns_stay_on_its_server_and_counters_sum(setup):
    url, servers = setup
    with httpx.Client(base_url=url, timeout=60) as client:
        before = [httpx.get(f"{s}/sessions").json()["turns"] for s in servers]
        messages = [{"role": "user", "content": "hi"}]
        for _ in range(3):
            r = client.post("/sessions/stay/v1/chat/completions", json={"messages": messages, **CHAT})
            assert r.status_code == 200, r.text
            messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
        turns = [httpx.get(f"{s}/sessions").json()["turns"] - b for s, b in zip(servers, before, strict=True)]
        assert sorted(turns) == [0, 3]  # every turn where the history is
        assert r.json()["session"]["reused_tokens"] > 0  # (the last turn extended the history it found there)
        history = client.get("/sessions/stay").json()
        assert history["num_turns"] == 3
        total = client.get("/sessions").json()
        assert total["turns"] == sum(httpx.get(f"{s}/sessions").json()["turns"] for s in servers)
        assert client.delete("/sessions/stay").status_code == 200
        assert client.get("/sessions/stay").status_code == 404  # the server's answer, relayed


def test_prefill_decode_mode_refuses_the_chat_routes():
    with router_thread(RouterConfig(prefill=("http://127.0.0.1:9",), decode=("http://127.0.0.1:10",))) as router:
        r = httpx.post(f"{router.url}/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400 and "prefill/decode" in r.text
