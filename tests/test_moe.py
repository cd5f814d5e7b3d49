"""Qwen3-MoE against Hugging Face's Qwen3MoeForCausalLM on the same random weights (fp32): logits, greedy generation
through the engine, checkpoints stored one tensor per expert."""

import asyncio
import dataclasses

import pytest
import torch
import transformers
from hf_ref import hf_model
from test_engine import GREEDY, hf_greedy, prompts
from test_model import rel_err

from tandem.config import PRESETS, EngineConfig, ModelConfig
from tandem.engine.engine import Engine
from tandem.model.attention import PackedCausal
from tandem.model.loader import WeightLoader, build_model, load_weights
from tandem.model.moe import Qwen3SparseMoeBlock
from tandem.model.qwen3 import Qwen3ForCausalLM, Qwen3MLP

# shapes that are not powers of two, dense layers mixed in two ways (mlp_only_layers, decoder_sparse_step)
MOE_SHAPES = {
    "dense_first_norm": ModelConfig(vocab_size=301, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                    num_attention_heads=3, num_key_value_heads=1, head_dim=16, rope_theta=10_000.0,
                                    num_experts=5, num_experts_per_tok=2, moe_intermediate_size=36,
                                    norm_topk_prob=True, mlp_only_layers=(0,)),
    "every_second_raw": ModelConfig(vocab_size=259, hidden_size=40, intermediate_size=72, num_hidden_layers=4,
                                    num_attention_heads=5, num_key_value_heads=5, head_dim=8, rope_theta=5000.0,
                                    tie_word_embeddings=True, num_experts=7, num_experts_per_tok=3,
                                    moe_intermediate_size=20, norm_topk_prob=False, decoder_sparse_step=2),
}


def twin(hf, config: ModelConfig) -> Qwen3ForCausalLM:
    ours = Qwen3ForCausalLM(config).eval()
    load_weights(ours, hf.state_dict().items(), strict=True)
    return ours


def test_a_layer_is_sparse_exactly_when_hugging_face_says():
    for config in MOE_SHAPES.values():
        hf = hf_model(config)
        ours = twin(hf, config)
        for hf_layer, layer in zip(hf.model.layers, ours.model.layers, strict=True):
            hf_sparse = isinstance(hf_layer.mlp, transformers.models.qwen3_moe.modeling_qwen3_moe.
                                   Qwen3MoeSparseMoeBlock)
            assert isinstance(layer.mlp, Qwen3SparseMoeBlock if hf_sparse else Qwen3MLP)
        assert {n for n, _ in ours.named_parameters()} == {n for n, _ in hf.named_parameters()}


@pytest.mark.parametrize("shape", sorted(MOE_SHAPES))
def test_prefill_logits_match_hf(shape):
    config = MOE_SHAPES[shape]
    hf = hf_model(config)
    ours = twin(hf, config)
    lens = [9, 17, 1]
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in lens]
    with torch.no_grad():
        logits = ours.compute_logits(ours(torch.cat(seqs), torch.cat([torch.arange(n) for n in lens]),
                                          PackedCausal(lens)))
        start = 0
        for seq in seqs:
            assert rel_err(logits[start:start + len(seq)], hf(seq[None]).logits[0]) < 1e-4
            start += len(seq)


@pytest.mark.parametrize("shape", sorted(MOE_SHAPES))
def test_greedy_generation_through_the_engine_equals_hf(shape):
    config = MOE_SHAPES[shape]
    hf = hf_model(config, seed=2)
    with Engine(twin(hf, config), EngineConfig(page_size=4, num_pages=64)) as engine:
        async def go(ps):  # batched: tokens of several requests share the experts' matrix multiplies
            return await asyncio.gather(*[engine.generate(p, GREEDY) for p in ps])
        ps = prompts(3, config.vocab_size, seed=4)
        for prompt, out in zip(ps, asyncio.run(go(ps)), strict=True):
            ids, logprobs = hf_greedy(hf, prompt, GREEDY.max_new_tokens)
            assert out.output_ids == ids
            assert out.output_logprobs == pytest.approx(logprobs, abs=1e-4)


def test_a_checkpoint_stored_per_expert_loads_and_one_missing_expert_is_named(tmp_path):
    config = MOE_SHAPES["dense_first_norm"]
    hf = hf_model(config, seed=1)
    hf.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
    from tandem.model.loader import iter_safetensors
    stored = dict(iter_safetensors(tmp_path / "ckpt"))
    assert "model.layers.1.mlp.experts.4.up_proj.weight" in stored  # Hugging Face stores one tensor per expert
    assert "model.layers.1.mlp.experts.gate_up_proj" not in stored
    ours = build_model(str(tmp_path / "ckpt"), dtype="float32")
    ids = torch.randint(0, config.vocab_size, (11,))
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(11), PackedCausal([11])))
    assert rel_err(logits, hf(ids[None]).logits[0]) < 1e-4

    fresh = Qwen3ForCausalLM(config).init_random(0)  # (torch.empty experts may hold NaN, never equal)
    before = {n: p.clone() for n, p in fresh.named_parameters()}
    partial = {n: t for n, t in stored.items() if n != "model.layers.2.mlp.experts.3.up_proj.weight"}
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        load_weights(fresh, partial.items(), strict=True)
    assert all(torch.equal(p, before[n]) for n, p in fresh.named_parameters())  # nothing copied
    for bad, match in [({"model.layers.1.mlp.experts.5.down_proj.weight": torch.zeros(48, 36)}, "expert 5"),
                       ({"model.layers.1.mlp.experts.0.gate_proj.weight": torch.zeros(36, 47)}, "shape"),
                       ({"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(36, 48)}, "no experts")]:
        with pytest.raises(ValueError, match=match):
            load_weights(fresh, bad.items())


def test_stacked_and_per_expert_updates_are_the_same_update():
    """The trainer sends stacked experts; a checkpoint holds one tensor per expert: both write the same values."""
    config = PRESETS["tiny-moe"]
    source = build_model(config, seed=5)
    stacked, per_expert = build_model(config, seed=6), build_model(config, seed=6)
    load_weights(stacked, source.named_parameters(), strict=True)
    named = {}
    for name, p in source.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            prefix, rows = name.rsplit(".", 1)[0], p.shape[1] // 2
            for j in range(p.shape[0]):
                named[f"{prefix}.{j}.gate_proj.weight"] = p[j, :rows]
                named[f"{prefix}.{j}.up_proj.weight"] = p[j, rows:]
        elif name.endswith("experts.down_proj"):
            prefix = name.rsplit(".", 1)[0]
            named |= {f"{prefix}.{j}.down_proj.weight": p[j] for j in range(p.shape[0])}
        else:
            named[name] = p
    WeightLoader(per_expert).load(named, strict=True)
    for (name, a), (_, b) in zip(stacked.named_parameters(), per_expert.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_the_moe_preset_and_the_published_shape():
    tiny, big = PRESETS["tiny-moe"], PRESETS["qwen3-30b-a3b"]
    assert tiny.is_moe and not tiny.is_sparse(0) and tiny.is_sparse(1)
    assert big.num_experts == 128 and big.num_experts_per_tok == 8 and big.num_hidden_layers == 48
    with torch.device("meta"):
        params = sum(p.numel() for p in Qwen3ForCausalLM(big).parameters())
    assert 30.0e9 < params < 31.0e9  # Qwen3-30B-A3B: 30.5B parameters
    assert ModelConfig.from_hf_dict(big.to_hf_dict()) == big
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        dataclasses.replace(tiny, num_experts_per_tok=7)
    assert dataclasses.replace(tiny, mlp_only_layers=[0, 2]).mlp_only_layers == (0, 2)  # (a list, as JSON gives it)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        dataclasses.replace(tiny, mlp_only_layers=["0"])
