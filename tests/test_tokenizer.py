"""The tokenizer loader and the shipped test tokenizer (tandem.tokenizer)."""

import json

import pytest

from tandem.tokenizer import load_tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=400)


def test_none_without_tokenizer_files(tmp_path):
    assert load_tokenizer("tiny") is None
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None


def test_round_trip_and_special_tokens(tokenizer):
    text = "What is 12 plus 30? <think>add</think>\n42"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) <= 400 and max(ids) < 400
    chat = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(chat, skip_special_tokens=True) == "user\nhi"
    assert tokenizer.eos_token == "<|im_end|>"


def test_train_is_deterministic(tokenizer, tmp_path):
    again = train_tokenizer(tmp_path, vocab_size=400)
    assert again.get_vocab() == tokenizer.get_vocab()


def test_template_drops_earlier_thinking_and_renders_tools(tokenizer):
    turns = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>add</think>\n4"}]
    now = tokenizer.apply_chat_template(turns, tokenize=False)
    later = tokenizer.apply_chat_template(turns + [{"role": "user", "content": "3+3?"}], tokenize=False,
                                          add_generation_prompt=True)
    assert "<think>add</think>" in now and "<think>" not in later  # not append-only, as Qwen3's
    assert later.endswith("<|im_start|>assistant\n")
    tool = {"type": "function", "function": {"name": "calculator", "parameters": {}}}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+2"}}}]}
    text = tokenizer.apply_chat_template(turns[:1] + [call, {"role": "tool", "content": "4"}], tools=[tool],
                                         tokenize=False)
    assert json.dumps(tool) in text
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>' in text
    assert "<tool_response>4</tool_response>" in text


def test_refuses_a_tokenizer_larger_than_the_vocabulary(tokenizer, tmp_path):
    train_tokenizer(tmp_path, vocab_size=400)
    with pytest.raises(ValueError, match="more than the model's vocab_size 300"):
        load_tokenizer(tmp_path, vocab_size=300)
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(ValueError, match="cannot load the tokenizer in"):
        load_tokenizer(tmp_path)
