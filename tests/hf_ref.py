"""Hugging Face reference models for the numeric checks (transformers is a test dependency only)."""

import torch
import transformers

from tandem.config import ModelConfig
from tandem.model.loader import load_weights
from tandem.model.qwen3 import Qwen3ForCausalLM

# Shapes that cover what differs between Qwen3 sizes: GQA ratio 1 and >1, tied and untied embeddings,
# head_dim not equal to hidden / heads.
SHAPES = {
    "gqa2_tied": ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             tie_word_embeddings=True, rope_theta=10000.0),
    "mha_untied": ModelConfig(vocab_size=257, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                              num_attention_heads=3, num_key_value_heads=3, head_dim=16,
                              tie_word_embeddings=False, rope_theta=1_000_000.0),
    "gqa4_wide_head": ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                                  tie_word_embeddings=False, rope_theta=5000.0),
}


def hf_model(config: ModelConfig, seed: int = 0) -> transformers.PreTrainedModel:
    """transformers' Qwen3ForCausalLM, or Qwen3MoeForCausalLM for a config with experts, with random weights."""
    torch.manual_seed(seed)
    moe = bool(config.num_experts)
    config_cls, model_cls = ((transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM) if moe
                             else (transformers.Qwen3Config, transformers.Qwen3ForCausalLM))
    hf_config = config_cls(**{k: v for k, v in config.to_hf_dict().items() if k not in ("architectures",
                                                                                        "torch_dtype")})
    hf_config._attn_implementation = "eager"
    model = model_cls(hf_config).float().eval()
    with torch.no_grad():  # norms start at ones and routers at zero in HF: perturb them so no mix-up can hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model


def tandem_twin(hf: transformers.Qwen3ForCausalLM, config: ModelConfig) -> Qwen3ForCausalLM:
    ours = Qwen3ForCausalLM(config).eval()
    load_weights(ours, hf.state_dict().items(), strict=True)
    return ours
