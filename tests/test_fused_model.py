"""The model's fused-kernel path (GPU inference) against its reference path, on the same weights."""

import pytest
import torch
from hf_ref import hf_model, tandem_twin

pytest.importorskip("triton")

from tandem.config import ModelConfig  # noqa: E402
from tandem.model.attention import PackedCausal  # noqa: E402
from tandem.model.loader import load_weights  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {  # the fused q/k-norm + RoPE kernel takes head_dim 64, 128 or 256
    "gqa2_tied": ModelConfig(vocab_size=200, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
    "mha_untied": ModelConfig(vocab_size=150, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=2, head_dim=128, rope_theta=10000.0),
}


@pytest.mark.parametrize("lens", [[5, 3], [1], [13, 9]], ids=["small-8", "small-1", "wide-22"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fused_forward_equals_reference_forward(shape, lens, monkeypatch):
    """Up to `small_linear.MAX_ROWS` rows the projections fuse the norms, the residual adds and SiLU
    (`_forward_small`); above it they run as matrix multiplies beside the fused norms (`_forward_fused`)."""
    config = SHAPES[shape]
    model = tandem_twin(hf_model(config), config).to(DEVICE)
    paths = []
    for path in ("_forward_small", "_forward_fused"):
        original = getattr(type(model), path)
        monkeypatch.setattr(type(model), path, lambda self, *a, _p=path, _f=original: paths.append(_p) or _f(self, *a))
    ids = torch.randint(0, config.vocab_size, (sum(lens),), device=DEVICE)
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    with torch.no_grad():
        ref = model(ids, positions, PackedCausal(lens))
        assert model.use_fused_kernels().fused is not None  # the fused path must really run
        fused = model(ids, positions, PackedCausal(lens))
    assert paths == ["_forward_small" if sum(lens) <= 16 else "_forward_fused"]
    torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fused_projections_follow_weights_loaded_by_name(shape):
    """q/k/v and gate/up run as one matrix each; a weight update by Hugging Face name must reach that matrix."""
    config = SHAPES[shape]
    model = tandem_twin(hf_model(config), config).to(DEVICE).use_fused_kernels()
    reference = tandem_twin(hf_model(config), config).to(DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    new = {name: p + 0.05 * torch.randn(p.shape, generator=gen, device=DEVICE) for name, p in model.named_parameters()}
    load_weights(model, new.items())
    load_weights(reference, new.items())
    lens = [4, 6]
    ids = torch.randint(0, config.vocab_size, (sum(lens),), device=DEVICE)
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, positions, PackedCausal(lens)),
                                   reference(ids, positions, PackedCausal(lens)), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 2, 8])
def test_packed_varlen_attention_and_its_gradients_equal_the_per_sequence_reference(groups):
    """The trainer's attention on CUDA in bf16 (one variable-length flash call) against one SDPA call per
    sequence, forward and backward, with a length-1 sequence and lengths that are not multiples of any block."""
    from tandem.model.attention import VARLEN

    assert VARLEN is not None, "this PyTorch has no torch.nn.attention.varlen"
    gen = torch.Generator(device="cuda").manual_seed(groups)
    lens, heads, dim = [1, 7, 130, 513, 64], 16, 128
    q, k, v = (torch.randn(sum(lens), h, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
               for h in (heads, heads // groups, heads // groups))
    grad = torch.randn(sum(lens), heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    results = []
    for fused in (True, False):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = PackedCausal(lens, fused=fused).attend(0, *leaves)
        out.backward(grad)
        results.append([out.detach(), *(x.grad for x in leaves)])
    for name, fast, ref in zip(["out", "dq", "dk", "dv"], *results, strict=True):
        err = ((fast.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 1e-2, (name, err)


@pytest.mark.parametrize("lens", [[9], [20, 0]], ids=["one-row", "two-rows-one-padding"])
def test_decode_step_with_attention_taking_fresh_keys_equals_the_reference_path(lens, monkeypatch):
    """A decode step of few rows through the Triton decode kernel, which takes q/k/v as projected
    (`attend_fresh`: q/k norm, RoPE and the KV write inside attention), against the reference path (PyTorch ops,
    `paged_decode_reference`): the same hidden states, the same keys and values in the cache."""
    from tandem.kernels.decode_attention import paged_decode_attention
    from tandem.model.attention import BlockTableDecode, paged_decode_reference

    config = SHAPES["gqa2_tied"]
    hf = hf_model(config)
    L, K, D, P = config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 16
    gen = torch.Generator().manual_seed(len(lens))
    caches = [torch.randn(L, 8 * P, K, D, generator=gen).to(DEVICE) for _ in range(2)]
    block_table = torch.tensor([[1 + 2 * b, 2 + 2 * b] for b in range(len(lens))], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    positions = (seq_lens - 1).clamp(min=0).long()
    slots = torch.where(seq_lens > 0, block_table[:, 0].long() * P + positions, 0)  # padding: the scratch slot 0
    ids = torch.randint(0, config.vocab_size, (len(lens),), generator=gen).to(DEVICE)
    fresh_calls = []
    monkeypatch.setattr(BlockTableDecode, "attend_fresh",
                        lambda self, *a, _f=BlockTableDecode.attend_fresh: fresh_calls.append(1) or _f(self, *a))
    results = []
    for kernel in (paged_decode_attention, paged_decode_reference):
        model = tandem_twin(hf, config).to(DEVICE)
        if kernel is paged_decode_attention:
            model.use_fused_kernels()
        k_cache, v_cache = (c.clone() for c in caches)
        ctx = BlockTableDecode(k_cache, v_cache, slots, block_table, seq_lens, P, kernel)
        with torch.no_grad():
            results.append((model(ids, positions, ctx)[seq_lens > 0], k_cache[:, P:], v_cache[:, P:]))
    assert len(fresh_calls) == L  # the fused model's every layer attended through attend_fresh
    for fast, ref in zip(*results, strict=True):
        torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)
