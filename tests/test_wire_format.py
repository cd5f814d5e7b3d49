"""SGLang's /generate wire format as RL clients speak it: the exact bodies Miles' and slime's rollouts build (nulls
included), what they read back (`text`, `output_ids`, `meta_info.output_token_logprobs`, `finish_reason`), with and
without a tokenizer; stop strings and stop tokens in the text; n samples; top logprobs; min_new_tokens."""

import asyncio

import httpx
import pytest
from wire_helpers import model_dir_with_tokenizer

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.server.http import ServerThread
from tandem.server.text import final_text
from tandem.types import SamplingParams

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def tokenizer_and_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    return model_dir_with_tokenizer(path), path


@pytest.fixture(scope="module")
def with_tok(tokenizer_and_dir):
    """A server whose model directory has a tokenizer: (httpx client, engine, tokenizer)."""
    tokenizer, path = tokenizer_and_dir
    with Engine(str(path), EngineConfig(page_size=16, max_batch_requests=8)) as engine, ServerThread(engine) as s:
        assert engine.tokenizer is not None
        with httpx.Client(base_url=s.url, timeout=60) as client:
            yield client, engine, tokenizer


@pytest.fixture(scope="module")
def without_tok():
    """A server of a preset model (no tokenizer): (httpx client, engine)."""
    with Engine("tiny", EngineConfig(page_size=16, max_batch_requests=8)) as engine, ServerThread(engine) as s:
        with httpx.Client(base_url=s.url, timeout=60) as client:
            yield client, engine


def miles_body(input_ids, **sampling):
    """What Miles' rollout posts (compute_sampling_params, compute_request_payload): every sampling field its
    defaults give, `stop` and `stop_token_ids` null, `no_stop_trim` true, `spaces_between_special_tokens` false."""
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 12, "stop": None,
              "stop_token_ids": None, "skip_special_tokens": True, "no_stop_trim": True,
              "spaces_between_special_tokens": False, **sampling}
    return {"input_ids": input_ids, "sampling_params": params, "return_logprob": True,
            "return_routed_experts": False, "return_indexer_topk": False}


def slime_body(input_ids, seed, **sampling):
    """What slime's sglang_rollout posts: its sampling params (top_p below 1 adds custom_params), a sampling_seed
    per sample of a group under deterministic inference, return_logprob."""
    params = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_new_tokens": 10, "stop": None,
              "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
              "spaces_between_special_tokens": False, "custom_params": {"return_top_p_token_ids": True},
              "sampling_seed": seed, **sampling}
    return {"sampling_params": params, "return_logprob": True, "input_ids": input_ids}


def read_back(reply):
    """What Miles and slime read of a reply: tokens and logprobs from output_token_logprobs, text, status."""
    assert reply.status_code == 200, reply.text
    out = reply.json()
    meta = out["meta_info"]
    tokens = [item[1] for item in meta["output_token_logprobs"]]
    logprobs = [item[0] for item in meta["output_token_logprobs"]]
    assert tokens == out["output_ids"] and len(logprobs) == meta["completion_tokens"] == len(tokens)
    assert meta["finish_reason"]["type"] in ("length", "stop", "abort") and "weight_version" in meta
    assert isinstance(out["text"], str)
    return out, tokens, logprobs


def test_a_miles_body_gets_text_ids_and_logprobs_with_a_tokenizer(with_tok):
    client, engine, tokenizer = with_tok
    body = miles_body(PROMPT)
    out, tokens, logprobs = read_back(client.post("/generate", json=body))
    assert out["text"] == tokenizer.decode(tokens, skip_special_tokens=True)  # no_stop_trim: nothing trimmed
    assert all(lp <= 0 for lp in logprobs) and len(tokens) >= 1
    # and Miles' eval body, which adds a cache namespace
    read_back(client.post("/generate", json={**body, "extra_key": "eval-aime"}))


def test_a_miles_body_gets_ids_and_logprobs_and_empty_text_without_a_tokenizer(without_tok):
    client, engine = without_tok
    out, tokens, _ = read_back(client.post("/generate", json=miles_body(PROMPT)))
    assert out["text"] == "" and tokens


def test_a_slime_body_is_seeded_by_sampling_seed(with_tok, without_tok):
    for client, *_ in (with_tok, without_tok):
        first, tokens, _ = read_back(client.post("/generate", json=slime_body(PROMPT, seed=11)))
        again, tokens_again, _ = read_back(client.post("/generate", json=slime_body(PROMPT, seed=11)))
        assert tokens == tokens_again
        seed_named = {**slime_body(PROMPT, seed=None), "sampling_params": {
            **slime_body(PROMPT, seed=None)["sampling_params"], "seed": 11}}
        assert read_back(client.post("/generate", json=seed_named))[1] == tokens  # tandem's name, the same seed


def test_every_field_null_is_the_default(with_tok):
    client, engine, _ = with_tok
    top = ["rid", "return_logprob", "return_text_in_logprobs", "top_logprobs_num", "stream", "logprob_start_len",
           "return_routed_experts", "extra_key", "return_indexer_topk", "return_sampling_mask", "image_data",
           "lora_path", "session_params", "custom_logit_processor", "token_ids_logprob", "priority"]
    sampling = ["temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
                "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "sampling_seed", "n",
                "min_new_tokens", "frequency_penalty", "presence_penalty", "repetition_penalty", "json_schema",
                "regex", "stop_regex", "logit_bias", "custom_params", "stream_interval"]
    body = {"input_ids": PROMPT, **dict.fromkeys(top), "sampling_params": {
        **dict.fromkeys(sampling), "max_new_tokens": 4, "temperature": 0}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    want = asyncio.run(engine.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0)))
    assert r.json()["output_ids"] == want.output_ids


@pytest.mark.parametrize("sampling, field", [
    ({"frequency_penalty": 0.5}, "sampling_params.frequency_penalty: tandem implements no penalties"),
    ({"repetition_penalty": 1.1}, "sampling_params.repetition_penalty"),
    ({"regex": "a+"}, "sampling_params.regex: tandem has no constrained decoding"),
    ({"skip_special_token": True}, "unknown field(s) ['skip_special_token']"),
    ({"no_stop_trim": "yes"}, "sampling_params.no_stop_trim: must be a boolean"),
    ({"stop": ["ok", 3]}, "sampling_params.stop: must be a non-empty string or a list of them"),
    ({"seed": 1, "sampling_seed": 2}, "sampling_params.sampling_seed: SGLang's name for seed"),
    ({"n": 0}, "sampling_params.n: must be an integer in [1, 64]"),
])
def test_unsupported_or_misspelled_sampling_fields_are_a_400_naming_them(with_tok, sampling, field):
    client, *_ = with_tok
    r = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": sampling})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    assert client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
        "frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1, "max_new_tokens": 1}}).is_success


def test_text_input_is_encoded_with_the_tokenizer_and_refused_without_one(with_tok, without_tok):
    client, engine, tokenizer = with_tok
    greedy = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    by_text = client.post("/generate", json={"text": "What is 12 plus 30?", "sampling_params": greedy}).json()
    ids = tokenizer.encode("What is 12 plus 30?")
    by_ids = client.post("/generate", json={"input_ids": ids, "sampling_params": greedy}).json()
    assert by_text["output_ids"] == by_ids["output_ids"] and by_text["meta_info"]["prompt_tokens"] == len(ids)
    batch = client.post("/generate", json={"text": ["a", "b c"], "sampling_params": greedy}).json()
    assert [o["meta_info"]["prompt_tokens"] for o in batch] == [len(tokenizer.encode(t)) for t in ("a", "b c")]
    r = without_tok[0].post("/generate", json={"text": "hi", "sampling_params": greedy})
    assert r.status_code == 400 and "text: this model directory has no tokenizer" in r.json()["error"]["message"]
    r = client.post("/generate", json={"text": "hi", "input_ids": [1]})
    assert r.status_code == 400 and "text: send text or input_ids, not both" in r.json()["error"]["message"]


def greedy_run(client, n=24):
    r = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": n, "ignore_eos": True, "skip_special_tokens": False}})
    return r.json()["output_ids"]


def completing(tokenizer, ids, min_index=2):
    """(k, s): a two-character string s that first appears in the decoded output at its k-th token."""
    for k in range(min_index, len(ids) + 1):
        before, now = tokenizer.decode(ids[:k - 1]), tokenizer.decode(ids[:k])
        if len(now) >= len(before) + 1 and len(now) >= 2 and now[-2:] not in before and "\ufffd" not in now[-2:]:
            return k, now[-2:]
    pytest.skip("no output text to cut (random weights chose tokens without text)")


def test_a_stop_string_ends_the_request_at_the_token_completing_it(with_tok):
    client, engine, tokenizer = with_tok
    ids = greedy_run(client)
    k, stop = completing(tokenizer, ids)
    sampling = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True, "skip_special_tokens": False,
                "stop": [stop, "\x00never"]}
    out = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": sampling,
                                         "return_logprob": True}).json()
    assert out["output_ids"] == ids[:k], (stop, ids)  # falsifier: without the stop, all 24 tokens (greedy_run)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(out["meta_info"]["output_token_logprobs"]) == out["meta_info"]["completion_tokens"] == k
    full = tokenizer.decode(ids[:k])
    assert out["text"] == full[:full.index(stop)]  # trimmed: the stop string and what follows
    kept = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
        **sampling, "no_stop_trim": True}}).json()
    assert kept["output_ids"] == ids[:k] and kept["text"] == full[:full.index(stop) + len(stop)]
    stats = asyncio.run(engine.get_stats())
    assert stats.num_running == 0  # the engine was told to stop it


def test_a_stop_token_ends_the_request_and_its_text_is_trimmed_unless_no_stop_trim(with_tok):
    client, engine, tokenizer = with_tok
    ids = greedy_run(client)
    k = next((i for i in range(1, len(ids)) if ids[i] not in ids[:i] and tokenizer.decode([ids[i]])), None)
    if k is None:
        pytest.skip("no token with text to stop at")
    sampling = {"temperature": 0, "max_new_tokens": 24, "stop_token_ids": [ids[k]], "skip_special_tokens": False}
    out = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": sampling}).json()
    assert out["output_ids"] == ids[:k + 1]  # the stop token is returned (RL trains on it)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}
    assert out["text"] == tokenizer.decode(ids[:k])
    kept = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
        **sampling, "no_stop_trim": True}}).json()
    assert kept["text"] == tokenizer.decode(ids[:k + 1])


def test_special_tokens_are_skipped_in_text_unless_asked(with_tok):
    client, engine, tokenizer = with_tok
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    out = asyncio.run(engine.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)))
    out.output_ids = [im_start, *out.output_ids]  # an output holding a special token
    for skip in (True, False):
        text = final_text(tokenizer, out, SamplingParams(skip_special_tokens=skip))
        assert text == tokenizer.decode(out.output_ids, skip_special_tokens=skip)
        assert ("<|im_start|>" in text) is not skip


def test_n_samples_of_a_prompt_come_back_in_order_seeded_one_apart(with_tok):
    client, engine, _ = with_tok
    sampling = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 5, "n": 3}
    outs = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": sampling, "rid": "grp"}).json()
    assert isinstance(outs, list) and [o["meta_info"]["id"] for o in outs] == ["grp_0", "grp_1", "grp_2"]
    for j, out in enumerate(outs):
        alone = asyncio.run(engine.generate(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=6,
                                                                   ignore_eos=True, seed=5 + j)))
        assert out["output_ids"] == alone.output_ids
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    two = client.post("/generate", json={"input_ids": [PROMPT, [9, 9]], "sampling_params": {**sampling, "n": 2,
                                                                                             "sampling_seed": None}})
    assert [o["meta_info"]["prompt_tokens"] for o in two.json()] == [4, 4, 2, 2]  # prompt by prompt, as SGLang


def test_top_logprobs_are_the_most_likely_tokens_with_the_sampled_ones_among_them(with_tok):
    client, engine, tokenizer = with_tok
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True}
    meta = client.post("/generate", json=body).json()["meta_info"]
    tops = meta["output_top_logprobs"]
    assert len(tops) == meta["completion_tokens"] == 5
    for (lp, token, text), top in zip(meta["output_token_logprobs"], tops, strict=True):
        assert len(top) == 3 and [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)
        assert top[0][:2] == [lp, token]  # greedy: the sampled token is the most likely, with its logprob
        assert text == tokenizer.decode([token]) and all(isinstance(t[2], str) for t in top)
    plain = client.post("/generate", json={**body, "top_logprobs_num": None}).json()["meta_info"]
    assert "output_top_logprobs" not in plain and [t[2] for t in plain["output_token_logprobs"]] == [
        tokenizer.decode([t[1]]) for t in plain["output_token_logprobs"]]


def test_min_new_tokens_bans_eos_and_stop_tokens_until_reached(without_tok):
    _, engine = without_tok
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    first = asyncio.run(engine.generate(PROMPT, greedy)).output_ids[0]
    stopping = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, stop_token_ids=(first,))
    assert asyncio.run(engine.generate(PROMPT, stopping)).output_ids == [first]  # falsifier: it stops at once
    held = asyncio.run(engine.generate(PROMPT, SamplingParams(
        temperature=0, max_new_tokens=6, ignore_eos=True, stop_token_ids=(first,), min_new_tokens=3)))
    assert len(held.output_ids) >= 3 and first not in held.output_ids[:3]


def test_top_logprobs_and_bans_against_a_reference():
    """The sampler's top logprobs are log_softmax(logits / temperature)'s largest (temperature 1 for greedy rows);
    a banned token is never sampled and has no probability, while the other rows are untouched."""
    import torch

    from tandem.engine.sampler import SamplingBatch, sample, top_logprobs

    B, V = 3, 50
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(0)) * 3
    temps = torch.tensor([0.0, 0.7, 1.3])
    batch = SamplingBatch(temperatures=temps, top_ps=torch.ones(B), top_ks=torch.zeros(B, dtype=torch.int64),
                          min_ps=torch.zeros(B), seeds=torch.arange(B), positions=torch.zeros(B, dtype=torch.int64),
                          needs_filter=False, top_logprobs_num=4)
    values, ids = top_logprobs(logits, batch)
    want = torch.log_softmax(logits / torch.tensor([1.0, 0.7, 1.3])[:, None], dim=-1).topk(4)
    torch.testing.assert_close(values, want.values)
    assert ids.tolist() == want.indices.tolist()
    greedy = int(logits[0].argmax())
    batch.banned = (torch.tensor([0]), torch.tensor([greedy]))
    tokens, _ = sample(logits, batch)
    assert int(tokens[0]) != greedy  # falsifier: unbanned, row 0 (greedy) takes it
    assert greedy not in top_logprobs(logits, batch)[1][0].tolist()
    unbanned = SamplingBatch(**{**batch.__dict__, "banned": None})
    assert int(sample(logits, unbanned)[0][0]) == greedy
    assert sample(logits, unbanned)[0][1:].tolist() == tokens[1:].tolist()
    assert int(sample(logits.bfloat16(), batch)[0][0]) != greedy  # (logits of the model's dtype)
