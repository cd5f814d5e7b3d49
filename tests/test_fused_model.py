"""The model's fused-kernel path (GPU inference) against its reference path, on the same weights."""

import pytest
import torch
from hf_ref import hf_model, tandem_twin

pytest.importorskip("triton")

from tandem.config import ModelConfig  # noqa: E402
from tandem.model.attention import PackedCausal  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {  # the fused q/k-norm + RoPE kernel takes head_dim 64, 128 or 256
    "gqa2_tied": ModelConfig(vocab_size=200, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
    "mha_untied": ModelConfig(vocab_size=150, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=2, head_dim=128, rope_theta=10000.0),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fused_forward_equals_reference_forward(shape):
    config = SHAPES[shape]
    model = tandem_twin(hf_model(config), config).to(DEVICE)
    lens = [5, 3]
    ids = torch.randint(0, config.vocab_size, (sum(lens),), device=DEVICE)
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    with torch.no_grad():
        ref = model(ids, positions, PackedCausal(lens))
        assert model.use_fused_kernels().fused is not None  # the fused path must really run
        fused = model(ids, positions, PackedCausal(lens))
    torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-4)
