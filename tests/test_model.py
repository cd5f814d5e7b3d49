"""The model against Hugging Face's Qwen3ForCausalLM on the same random weights (fp32)."""

import pytest
import torch
from hf_ref import SHAPES, hf_model, tandem_twin

from tandem.model.attention import PackedCausal
from tandem.model.loader import build_model, load_weights


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_prefill_logits_match_hf(shape):
    config = SHAPES[shape]
    hf = hf_model(config)
    ours = tandem_twin(hf, config)
    gen = torch.Generator().manual_seed(1)
    lens = [7, 19, 1]
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in lens]
    with torch.no_grad():
        hidden = ours(torch.cat(seqs), torch.cat([torch.arange(n) for n in lens]), PackedCausal(lens))
        logits = ours.compute_logits(hidden)
        start = 0
        for seq in seqs:
            ref = hf(seq[None]).logits[0]
            assert rel_err(logits[start:start + len(seq)], ref) < 1e-4
            start += len(seq)


def test_save_pretrained_directory_loads_with_same_logits(tmp_path):
    config = SHAPES["gqa4_wide_head"]
    hf = hf_model(config)
    hf.save_pretrained(tmp_path / "ckpt", max_shard_size="40KB")  # force several shards + index
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    ours = build_model(str(tmp_path / "ckpt"), dtype="float32")
    ids = torch.randint(0, config.vocab_size, (12,))
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(12), PackedCausal([12])))
        assert rel_err(logits, hf(ids[None]).logits[0]) < 1e-4


def test_single_file_checkpoint_and_tied_head(tmp_path):
    config = SHAPES["gqa2_tied"]
    hf = hf_model(config)
    hf.save_pretrained(tmp_path / "one")
    ours = build_model(str(tmp_path / "one"), dtype="float32")
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = torch.randint(0, config.vocab_size, (5,))
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(5), PackedCausal([5])))
        assert rel_err(logits, hf(ids[None]).logits[0]) < 1e-4


def test_load_weights_rejects_bad_tensors_and_changes_nothing():
    model = build_model("tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    good = torch.zeros_like(model.model.norm.weight)
    with pytest.raises(ValueError, match="unknown parameter 'model.nope'"):
        load_weights(model, [("model.norm.weight", good), ("model.nope", good)])
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        load_weights(model, [("model.norm.weight", torch.zeros(3))])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_presets_and_random_init_are_reproducible():
    a, b = build_model("tiny", seed=3), build_model("tiny", seed=3)
    c = build_model("tiny", seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
