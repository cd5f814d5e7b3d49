"""Session-scoped chat (tandem.server.sessions): a session's history keeps the sampled ids where re-tokenizing the
conversation would change them (a template that drops earlier thinking, BPE that merges what was sampled apart)."""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from chat_models import chain_model_dir

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.server import chat
from tandem.server.http import ServerThread
from tandem.server.sessions import SessionStore
from tandem.tokenizer import train_tokenizer

GREEDY = {"temperature": 0, "max_tokens": 20}
HI = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A server whose model answers every user turn with "<think>ok</think>the" sampled as single characters."""
    path = tmp_path_factory.mktemp("chain")
    tokenizer = train_tokenizer(path)
    chain = tokenizer.convert_tokens_to_ids(["Ċ", "<think>", "o", "k", "</think>", "t", "h", "e", "<|im_end|>"])
    chain_model_dir(path, chain)
    with Engine(str(path), EngineConfig(page_size=16)) as engine, ServerThread(engine) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client, tokenizer, chain[1:]


def session_chat(client, session, messages, **extra):
    r = client.post(f"/sessions/{session}/v1/chat/completions", json={"messages": messages, **GREEDY, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_session_keeps_sampled_ids_where_retokenizing_changes_them(setup):
    client, tokenizer, sampled = setup
    first = session_chat(client, "keep", [HI])
    choice = first["choices"][0]
    assert choice["token_ids"] == sampled and choice["message"]["content"] == "<think>ok</think>the"
    conversation = [HI, choice["message"], {"role": "user", "content": "more"}]

    second = session_chat(client, "keep", conversation)
    prompt = second["choices"][0]["prompt_token_ids"]
    assert prompt[:len(choice["prompt_token_ids"]) + len(sampled)] == choice["prompt_token_ids"] + sampled
    assert second["session"]["reused_tokens"] == len(choice["prompt_token_ids"]) + len(sampled)
    assert not second["session"]["fallback"] and second["session"]["num_fallbacks"] == 0
    # the falsifier: the plain endpoint re-tokenizes, which drops the thinking and merges "t", "h", "e"
    plain = client.post("/v1/chat/completions", json={"messages": conversation, **GREEDY}).json()
    retokenized = plain["choices"][0]["prompt_token_ids"]
    assert sampled[:4] not in [retokenized[i:i + 4] for i in range(len(retokenized))]
    assert tokenizer.decode(retokenized) != tokenizer.decode(prompt)
    # both end with the same appended turn, tokenized alike
    suffix = prompt[len(choice["prompt_token_ids"]) + len(sampled):]
    assert retokenized[-len(suffix):] == suffix

    history = client.get("/sessions/keep").json()
    assert history["token_ids"] == prompt + second["choices"][0]["token_ids"]
    mask = history["loss_mask"]
    assert [t for t, m in zip(history["token_ids"], mask, strict=True) if m] == sampled + sampled
    assert [v for v, m in zip(history["weight_versions"], mask, strict=True) if m] == [0] * 16
    assert history["logprobs"][len(choice["prompt_token_ids"])] == choice["meta_info"]["output_token_logprobs"][0][0]


def test_a_conversation_that_does_not_extend_the_history_falls_back_and_is_counted(setup):
    client, tokenizer, sampled = setup
    first = session_chat(client, "edit", [HI])["choices"][0]
    before = client.get("/sessions").json()
    edited = {**first["message"], "content": "the"}  # not what the session returned
    second = session_chat(client, "edit", [HI, edited, {"role": "user", "content": "more"}])
    assert second["session"]["fallback"] and second["session"]["num_fallbacks"] == 1
    assert second["session"]["reused_tokens"] == 0
    after = client.get("/sessions").json()
    assert after["fallbacks"] == before["fallbacks"] + 1 and after["turns"] == before["turns"] + 1
    metrics = client.get("/metrics").text  # the same counters for Prometheus
    assert f"tandem:session_fallbacks_total {float(after['fallbacks'])}" in metrics
    assert f"tandem:sessions_active {float(after['active'])}" in metrics
    # the history starts over from the re-tokenized conversation: the first turn's sampled ids are gone from it
    history = client.get("/sessions/edit").json()
    assert sum(history["loss_mask"]) == len(sampled)
    # an extension of the new history is reused again
    third = session_chat(client, "edit", [HI, edited, {"role": "user", "content": "more"}, second["choices"][0][
        "message"], {"role": "user", "content": "again"}])
    assert not third["session"]["fallback"] and third["session"]["reused_tokens"] == len(history["token_ids"])


def test_a_turn_cut_by_length_is_closed_with_the_end_of_turn_token(setup):
    client, tokenizer, sampled = setup
    first = session_chat(client, "cut", [HI], max_tokens=3)["choices"][0]
    assert first["finish_reason"] == "length" and first["token_ids"] == sampled[:3]
    second = session_chat(client, "cut", [HI, first["message"], {"role": "user", "content": "go"}])
    prompt = second["choices"][0]["prompt_token_ids"]
    n = len(first["prompt_token_ids"])
    assert prompt[n:n + 4] == sampled[:3] + [tokenizer.eos_token_id]


def test_sessions_are_deleted_refused_when_bad_and_n_must_be_one(setup):
    client, _, _ = setup
    session_chat(client, "gone", [HI])
    assert client.delete("/sessions/gone").json()["deleted"]
    r = client.get("/sessions/gone")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert client.delete("/sessions/gone").status_code == 404
    r = client.post("/sessions/x/v1/chat/completions", json={"messages": [HI], "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = client.post(f"/sessions/{'x' * 200}/v1/chat/completions", json={"messages": [HI]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"


def test_store_bounds_sessions_by_count_and_idle_time():
    now = [0.0]
    store = SessionStore(max_sessions=2, ttl_s=10, clock=lambda: now[0])
    store.get("a", create=True)
    store.get("b", create=True)
    store.get("a")  # a is now the more recently used
    store.get("c", create=True)
    assert list(store.sessions) == ["a", "c"] and store.counts["evicted"] == 1
    now[0] = 5.0
    store.get("c")
    now[0] = 12.0
    assert store.get("a") is None and store.get("c") is not None and store.counts["expired"] == 1
    with pytest.raises(ValueError, match="max_sessions"):
        SessionStore(max_sessions=0)


def test_render_suffix_tokenizes_as_the_whole_conversation_does(tmp_path):
    """For turns the template renders alike later (no thinking), history + suffix == re-tokenizing the whole."""
    tokenizer = train_tokenizer(tmp_path)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 + 30"}}}
    turns = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 12 plus 30?"},
             {"role": "assistant", "content": "Let me compute.", "tool_calls": [call]}]
    appended = [{"role": "tool", "content": "42"}, {"role": "user", "content": "And then?"}]
    for tool_list in (None, tools):
        whole = chat.encode(tokenizer, chat.render(tokenizer, turns + appended, tool_list, None))
        history = chat.encode(tokenizer, chat.render(tokenizer, turns, tool_list, None, generation_prompt=False))
        history = history[:len(history) - history[::-1].index(tokenizer.eos_token_id)]  # through the last <|im_end|>
        suffix = chat.encode(tokenizer, chat.render_suffix(tokenizer, appended, tool_list, None))
        assert history + suffix == whole


def test_one_request_at_a_time_per_session(setup):
    client, _, _ = setup
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(client.post, "/sessions/busy/v1/chat/completions",
                           json={"messages": [HI], "max_tokens": 400, "ignore_eos": True, "temperature": 0})
        deadline = time.monotonic() + 30
        while client.get("/engine_stats").json()["num_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = client.post("/sessions/busy/v1/chat/completions", json={"messages": [HI], **GREEDY})
        assert r.status_code == 409 and r.json()["error"]["code"] == "busy"
        assert long.result().status_code == 200
    assert client.get("/sessions/busy").json()["num_turns"] == 1
