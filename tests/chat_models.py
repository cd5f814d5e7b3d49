"""Model directories for the chat tests: the tiny preset's config.json beside the shipped test tokenizer (random
weights), and a model whose greedy output is a chosen token chain (weights written as safetensors)."""

import json
from pathlib import Path

from safetensors.torch import save_file

from tandem.config import PRESETS
from tandem.model.loader import build_model
from tandem.tokenizer import train_tokenizer


def chat_model_dir(path: Path):
    """config.json (tiny, its EOS the tokenizer's end of turn) and the tokenizer; returns the tokenizer."""
    tokenizer = train_tokenizer(path)
    config = PRESETS["tiny"].to_hf_dict() | {"eos_token_id": tokenizer.eos_token_id}
    (path / "config.json").write_text(json.dumps(config))
    return tokenizer


def chain_model_dir(path: Path, chain: list[int]):
    """A chat model directory whose greedy next token after `chain[k]` is `chain[k + 1]`, whatever came before:
    attention and MLP outputs are zero, so the last hidden state is the current token's embedding, and the output
    row of `chain[k + 1]` is that embedding's direction, scaled far above the others' chance alignment. The tokens
    of `chain[:-1]` must be distinct."""
    assert len(set(chain[:-1])) == len(chain) - 1
    tokenizer = chat_model_dir(path)
    model = build_model(str(path), dtype="float32", seed=0)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    head.zero_()
    for current, following in zip(chain[:-1], chain[1:], strict=True):
        head[following] = 10 * embed[current] / embed[current].norm()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return tokenizer


def token_ids(tokenizer, *tokens: str) -> list[int]:
    ids = tokenizer.convert_tokens_to_ids(list(tokens))
    assert tokenizer.unk_token_id not in ids or tokenizer.unk_token_id is None
    return ids

