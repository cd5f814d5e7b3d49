"""Shared by the wire-format and streaming tests: a random tiny model beside a tokenizer trained on shipped text,
served over real HTTP, and the reading of SGLang's server-sent events."""

import dataclasses
import json

from tandem.config import PRESETS
from tandem.tokenizer import train_tokenizer


def model_dir_with_tokenizer(path):
    """A model directory: the tiny preset's `config.json` (EOS the tokenizer's) and a trained tokenizer; no
    weights (random ones). Returns the tokenizer."""
    tokenizer = train_tokenizer(path, vocab_size=400)
    config = dataclasses.replace(PRESETS["tiny"], eos_token_id=tokenizer.eos_token_id)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return tokenizer


def events(response) -> list:
    """The JSON chunks of a streamed /generate reply (httpx), checking it ends with `data: [DONE]`."""
    lines = [line for line in response.iter_lines() if line]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    assert all(line.startswith("data: ") for line in lines), lines
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]
