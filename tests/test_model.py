"""The model against Hugging Face's Qwen3ForCausalLM on the same random weights (fp32)."""

import dataclasses
import json

import pytest
import torch
from hf_ref import SHAPES, hf_model, tandem_twin

from tandem.model.attention import PackedCausal
from tandem.model.loader import WeightLoader, build_model, iter_safetensors, load_weights
from tandem.transport.weights import FlatTensors


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
    with pytest.raises(ValueError, match="model.norm.weight has dtype torch.int64, expected a floating-point"):
        load_weights(model, [("model.norm.weight", good.long())])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def flat_buckets(named: list[tuple[str, torch.Tensor]], sizes: list[int]) -> FlatTensors:
    """The tensors packed back to back into buckets of `sizes` tensors each, as a transport delivers them."""
    buckets, start = [], 0
    for size in sizes:
        part = named[start:start + size]
        buckets.append(([n for n, _ in part], [list(t.shape) for _, t in part],
                        torch.cat([t.reshape(-1) for _, t in part])))
        start += size
    return FlatTensors(buckets)


def test_flat_tensors_load_as_their_named_tensors_do_checked_before_any_copy():
    """A transport's flat buckets are copied piece by piece into flat views of the parameters (no per-tensor view);
    the result equals loading the same tensors by name, a tied head included, and a bad tensor changes nothing."""
    new = list(build_model("small", seed=5).named_parameters()) + [("lm_head.weight", None)]
    new[-1] = ("lm_head.weight", new[0][1])  # tied in this shape: given, not copied
    flat = flat_buckets([(n, t.detach()) for n, t in new], [3, len(new) - 3])
    assert len(flat) == len(new) and all(torch.equal(flat[n], t) for n, t in new)
    by_flat, by_name = build_model("small", seed=1), build_model("small", seed=1)
    assert WeightLoader(by_flat).load(flat, strict=True) == load_weights(by_name, flat.items(), strict=True)
    for (name, a), b in zip(by_flat.named_parameters(), by_name.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, flat[name]), name

    model = build_model("small", seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    named = [(n, t.detach()) for n, t in new[:-1]]
    for bad, match in [(("model.nope", named[0][1]), "unknown parameter 'model.nope'"),
                       ((named[-1][0], torch.zeros(3)), f"{named[-1][0]} has shape")]:
        with pytest.raises(ValueError, match=match):  # the bad tensor comes last, in the second bucket
            WeightLoader(model).load(flat_buckets(named[:-1] + [bad], [3, len(named) - 3]))
    with pytest.raises(ValueError, match="has dtype torch.int64, expected a floating-point"):  # an integer bucket
        WeightLoader(model).load(flat_buckets([(n, t.long()) for n, t in named], [3, len(named) - 3]))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_flat_load_follows_a_parameter_given_new_storage():
    """The flat views are kept between loads: one made before the parameter got new storage (as fused kernels
    concatenate q/k/v) must not receive the next load."""
    model = build_model("tiny", seed=1)
    loader = WeightLoader(model)
    named = [(n, t.detach()) for n, t in build_model("tiny", seed=2).named_parameters()]
    loader.load(flat_buckets(named, [len(named)]))
    norm = model.model.norm.weight
    norm.data = torch.zeros_like(norm)  # new storage
    named = [(n, t.detach()) for n, t in build_model("tiny", seed=3).named_parameters()]
    loader.load(flat_buckets(named, [len(named)]))
    assert torch.equal(norm, dict(named)["model.norm.weight"])


def test_presets_and_random_init_are_reproducible():
    a, b = build_model("tiny", seed=3), build_model("tiny", seed=3)
    c = build_model("tiny", seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


@pytest.mark.parametrize("tied", [False, True])
def test_a_padded_vocabulary_loads_and_round_trips_on_every_tp_rank(tmp_path, tied):
    """Vocabulary 50,257 over 3 ranks: each rank's embedding and head hold cdiv(V, 3) rows. Loaded from a Hugging
    Face safetensors checkpoint (full tensors), the ranks' real rows put back together are the checkpoint's
    tensors, and every padding row is zero; an in-place update (full tensors again) round-trips the same way."""
    from tandem.distributed.parallel import TPGroup, cdiv

    config = dataclasses.replace(SHAPES["gqa2_tied"], vocab_size=50_257, hidden_size=8, intermediate_size=12,
                                 num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3, head_dim=4,
                                 tie_word_embeddings=tied)
    hf_model(config).save_pretrained(tmp_path / "ckpt")
    full = dict(iter_safetensors(tmp_path / "ckpt"))
    size, rows = 3, cdiv(config.vocab_size, 3)
    ranks = [build_model(str(tmp_path / "ckpt"), dtype="float32", tp=TPGroup(r, size)) for r in range(size)]
    update = {n: torch.randn_like(t) for n, t in full.items()}
    for expected in (full, update):
        if expected is update:
            for model in ranks:
                load_weights(model, update.items())
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            weights = [dict(model.named_parameters(remove_duplicate=False))[name] for model in ranks]
            assert all(w.shape == (rows, config.hidden_size) for w in weights)
            real = torch.cat(weights)[:config.vocab_size]
            source = "model.embed_tokens.weight" if tied else name
            assert torch.equal(real, expected[source]), name
            assert not torch.cat(weights)[config.vocab_size:].any(), "padding rows must stay zero"
    assert all(model.lm_head.weight is model.model.embed_tokens.weight for model in ranks) == tied


@pytest.mark.parametrize("field,shape", [
    ("head_dim", dict(head_dim=288)),
    ("num_attention_heads", dict(num_attention_heads=34, num_key_value_heads=2)),  # 17 query heads per kv head
    ("hidden_size", dict(hidden_size=16_400)),
])
def test_a_shape_the_gpu_kernels_cannot_take_is_refused_as_the_engine_loads_the_model(field, shape):
    """A GPU engine switches the model to the Triton kernels as it loads it (`use_fused_kernels`): a shape they
    cannot take is a ValueError naming the field there, not an assertion inside a kernel at the first step.
    The PyTorch path (CPU) takes any shape."""
    from tandem.model.qwen3 import Qwen3ForCausalLM

    config = dataclasses.replace(SHAPES["gqa2_tied"], **shape)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
        with pytest.raises(ValueError, match=field):
            model.use_fused_kernels()
        Qwen3ForCausalLM(SHAPES["gqa2_tied"]).use_fused_kernels()  # (a shape they take)


def test_an_odd_head_dim_is_refused_when_a_checkpoint_loads(tmp_path):
    config = SHAPES["gqa2_tied"].to_hf_dict() | {"head_dim": 81}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="head_dim"):
        build_model(str(tmp_path))
