"""The OpenAI-compatible endpoints through the official `openai` client, against a real server (uvicorn in a thread)
serving a tiny random model with the shipped test tokenizer."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from chat_models import chat_model_dir

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.server import chat
from tandem.server.http import ServerThread

HI = [{"role": "user", "content": "What is 12 plus 30?"}]
CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic",
                                               "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tokenizer = chat_model_dir(tmp_path_factory.mktemp("chat"))
    with Engine(tokenizer.name_or_path, EngineConfig(page_size=16)) as engine, ServerThread(engine) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0), server, tokenizer


def test_models_and_completions(served):
    client, _, tokenizer = served
    assert [m.id for m in client.models.list().data] == [tokenizer.name_or_path.rsplit("/", 1)[-1]]
    reply = client.completions.create(model="any", prompt="What is 12 plus", max_tokens=6, n=2, seed=5, logprobs=0,
                                      temperature=1.0)
    again = client.completions.create(model="any", prompt="What is 12 plus", max_tokens=6, n=2, seed=5)
    assert [c.text for c in reply.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert reply.choices[0].model_extra["token_ids"] != reply.choices[1].model_extra["token_ids"]  # seed + j
    for c in reply.choices:
        extra = c.model_extra
        assert extra["prompt_token_ids"] == tokenizer.encode("What is 12 plus", add_special_tokens=False)
        assert tokenizer.decode(extra["token_ids"]) == c.text
        meta = extra["meta_info"]
        assert c.logprobs.token_logprobs == [lp for lp, _, _ in meta["output_token_logprobs"]]
        assert meta["output_token_weight_versions"] == [0] * len(extra["token_ids"])
    assert reply.usage.prompt_tokens == len(extra["prompt_token_ids"]) and reply.usage.completion_tokens == sum(
        len(c.model_extra["token_ids"]) for c in reply.choices)


def test_chat_completion_returns_the_exact_ids(served):
    client, _, tokenizer = served
    reply = client.chat.completions.create(model="any", messages=HI, max_completion_tokens=8, seed=3, logprobs=True)
    choice = reply.choices[0]
    ids = choice.model_extra["token_ids"]
    prompt = tokenizer.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    assert choice.model_extra["prompt_token_ids"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
    assert len(ids) <= 8 and choice.finish_reason in ("stop", "length")
    assert [t.logprob for t in choice.logprobs.content] == [lp for lp, _, _ in
                                                            choice.model_extra["meta_info"]["output_token_logprobs"]]


def test_top_logprobs(served):
    client, _, _ = served
    reply = client.chat.completions.create(model="any", messages=HI, max_tokens=4, logprobs=True, top_logprobs=3)
    for token in reply.choices[0].logprobs.content:
        assert len(token.top_logprobs) == 3 and token.logprob <= token.top_logprobs[0].logprob + 1e-6
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
    text = client.completions.create(model="any", prompt="Hello", max_tokens=4, logprobs=2).choices[0]
    assert [len(top) for top in text.logprobs.top_logprobs] == [2] * len(text.model_extra["token_ids"])


def test_tools_reach_the_template(served):
    client, _, tokenizer = served
    reply = client.chat.completions.create(model="any", messages=HI, tools=[CALCULATOR], max_tokens=2)
    rendered = tokenizer.decode(reply.choices[0].model_extra["prompt_token_ids"])
    assert json.dumps(CALCULATOR) in rendered and "<tool_call>" in rendered


def test_streams_give_what_the_whole_reply_gives(served):
    client, _, _ = served
    whole = client.chat.completions.create(model="any", messages=HI, max_tokens=8, seed=9)
    chunks = list(client.chat.completions.create(model="any", messages=HI, max_tokens=8, seed=9, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    streamed_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert streamed_ids == whole.choices[0].model_extra["token_ids"]
    assert len(chunks) > 4  # as the tokens are sampled, not at once
    text = client.completions.create(model="any", prompt="Hello", max_tokens=8, seed=9)
    streamed = list(client.completions.create(model="any", prompt="Hello", max_tokens=8, seed=9, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text


def test_stop_strings_cut_the_text_and_the_ids(served):
    client, _, tokenizer = served
    full = client.completions.create(model="any", prompt="The engine", max_tokens=24, seed=11, temperature=1.0)
    text, ids = full.choices[0].text, full.choices[0].model_extra["token_ids"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip("\ufffd")
    cut = client.completions.create(model="any", prompt="The engine", max_tokens=24, seed=11, stop=[stop]).choices[0]
    kept = cut.model_extra["token_ids"]
    assert cut.text == text[:text.index(stop)] and cut.finish_reason == "stop"
    assert kept == ids[:len(kept)] and stop in tokenizer.decode(kept) and stop not in tokenizer.decode(kept[:-1])
    assert cut.model_extra["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_errors_are_openai_shaped(served):
    client, server, _ = served
    cases = [
        (dict(top_logprobs=21, logprobs=True), "top_logprobs"),
        (dict(max_tokens=10**6), "prompt"),
        (dict(temperature=-1), "temperature"),
        (dict(extra_body={"max_tokns": 3}), "max_tokns"),
        (dict(extra_body={"logit_bias": {"5": 1.0}}), "logit_bias"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="any", messages=HI, **kwargs)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kwargs, e.value.body)
        assert set(e.value.body) == {"message", "type", "param", "code"}
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_without_a_tokenizer_chat_is_a_clear_400_and_token_prompts_still_work():
    with Engine("tiny", EngineConfig(page_size=16)) as engine, ServerThread(engine) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="has none") as e:
            client.chat.completions.create(model="any", messages=HI)
        assert e.value.body["code"] == "no_tokenizer"
        reply = client.completions.create(model="any", prompt=[1, 2, 3], max_tokens=4, seed=1)
        assert reply.choices[0].text == "" and len(reply.choices[0].model_extra["token_ids"]) <= 4


def test_tool_calls_are_parsed_from_tool_call_json():
    content, calls = chat.parse_tool_calls('Let me see.<tool_call>{"name": "calculator", "arguments": '
                                           '{"expression": "12 + 30"}}</tool_call><tool_call>{bad json}</tool_call>')
    assert content == "Let me see.<tool_call>{bad json}</tool_call>"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("calculator", {"expression": "12 + 30"})]
    assert chat.parse_tool_calls("no calls") == ("no calls", [])


def test_a_reply_cut_by_an_abort_pause_is_continued(served):
    """A weight update's abort-mode pause ends the engine's request; the endpoint resubmits it with its output so
    far, so the client gets every token it asked for (falsifier: without the resubmission the reply is short)."""
    _, server, _ = served
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server.url, timeout=60) as http:
        future = pool.submit(http.post, "/v1/chat/completions", json={
            "messages": HI, "max_tokens": 400, "ignore_eos": True, "seed": 1})
        deadline = time.monotonic() + 30
        while http.get("/engine_stats").json()["generated_tokens"] < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert http.post("/pause_generation", json={"mode": "abort"}).status_code == 200
        assert http.post("/continue_generation").status_code == 200
        choice = future.result().json()["choices"][0]
    assert len(choice["token_ids"]) == 400 and choice["finish_reason"] == "length"
    assert len(choice["meta_info"]["output_token_weight_versions"]) == 400


def test_a_refused_stream_is_a_400_before_any_event(served):
    _, server, _ = served
    for path, body in [("/v1/completions", {"prompt": "Hi", "max_tokens": 10**6}),
                       ("/v1/chat/completions", {"messages": HI, "max_tokens": 10**6})]:
        r = httpx.post(f"{server.url}{path}", json=body | {"stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
