"""A model's shape: `ModelConfig` read from a Hugging Face `config.json` (Qwen3 dense or Qwen3-MoE), the named
presets, and `resolve_model` (a preset name or a checkpoint directory). Importable without torch; each field's
annotation is its contract (`tandem.config_checks`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tandem.config_checks import NonNegativeInt, PositiveFloat, PositiveInt, check_fields

Dtype = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt
    head_dim: PositiveInt
    max_position_embeddings: PositiveInt = 40960
    rope_theta: PositiveFloat = 1_000_000.0
    rms_norm_eps: PositiveFloat = 1e-6
    tie_word_embeddings: bool = False
    eos_token_id: NonNegativeInt | None = None
    dtype: Dtype = "float32"
    # mixture of experts (Qwen3-MoE, Hugging Face's fields and meaning): a layer's MLP is sparse exactly when
    # `is_sparse(layer)`; the others are dense MLPs of `intermediate_size`
    num_experts: NonNegativeInt = 0  # 0: a dense model
    num_experts_per_tok: PositiveInt = 8
    moe_intermediate_size: PositiveInt = 768
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to one
    decoder_sparse_step: PositiveInt = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if isinstance(self.mlp_only_layers, list):  # (as JSON and TOML give it)
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        check_fields(self)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("model.num_attention_heads: must be a multiple of num_key_value_heads "
                             f"({self.num_key_value_heads}), got {self.num_attention_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim: must be even for RoPE, got {self.head_dim}")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"model.num_experts_per_tok: must be at most num_experts ({self.num_experts}), "
                             f"got {self.num_experts_per_tok}")

    @property
    def is_moe(self) -> bool:
        return any(self.is_sparse(layer) for layer in range(self.num_hidden_layers))

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a mixture-of-experts MLP (Hugging Face's rule)."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        """Build from a Hugging Face Qwen3 or Qwen3-MoE `config.json` dict (transformers 4.x `rope_theta` or 5.x
        `rope_parameters`). Unknown keys are ignored."""
        model_type = d.get("model_type", "qwen3")
        arch = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}.get(model_type)
        archs = d.get("architectures") or [arch]
        if arch is None or arch not in archs:
            raise ValueError(f"model config: only Qwen3ForCausalLM (model_type qwen3) and Qwen3MoeForCausalLM "
                             f"(model_type qwen3_moe) are supported, got model_type={model_type!r} "
                             f"architectures={archs}")
        moe = {}
        if model_type == "qwen3_moe":
            moe = dict(num_experts=d.get("num_experts", d.get("num_local_experts", 128)),  # (transformers 5's name)
                       num_experts_per_tok=d.get("num_experts_per_tok", 8),
                       moe_intermediate_size=d.get("moe_intermediate_size", 768),
                       norm_topk_prob=d.get("norm_topk_prob", False),
                       decoder_sparse_step=d.get("decoder_sparse_step", 1),
                       mlp_only_layers=tuple(d.get("mlp_only_layers") or ()))
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"model config: rope scaling {rope.get('rope_type')!r} is not supported")
        theta = d.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        heads = d["num_attention_heads"]
        dtype = {"bfloat16": "bfloat16", "float16": "float16"}.get(str(d.get("torch_dtype") or d.get("dtype")),
                                                                    "float32")
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d.get("max_position_embeddings", 40960), rope_theta=float(theta),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), tie_word_embeddings=d.get("tie_word_embeddings", False),
            eos_token_id=eos, dtype=dtype, **moe,
        )

    def to_hf_dict(self) -> dict:
        """The `config.json` Hugging Face would write for this shape (Qwen3-MoE's when it has experts)."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("dtype", *_MOE_FIELDS)}
        d.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
                 attention_bias=False, torch_dtype=self.dtype)
        if self.num_experts:
            d.update({k: getattr(self, k) for k in _MOE_FIELDS}, mlp_only_layers=list(self.mlp_only_layers),
                     architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
        return d

    def with_(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
               "mlp_only_layers")

# Named shapes. "tiny" and "tiny-moe" are for tests and the CPU demo; the others match the published Qwen3 configs.
_QWEN3_COMMON = dict(vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000.0,
                     eos_token_id=151645, head_dim=128, dtype="bfloat16")
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        max_position_embeddings=4096, rope_theta=10_000.0, tie_word_embeddings=False,
                        eos_token_id=1),
    "small": ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                         max_position_embeddings=8192, rope_theta=10_000.0, tie_word_embeddings=True,
                         eos_token_id=1),
    "qwen3-0.6b": ModelConfig(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True,
                              **_QWEN3_COMMON),
    "qwen3-1.7b": ModelConfig(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True,
                              **_QWEN3_COMMON),
    "qwen3-4b": ModelConfig(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                            **_QWEN3_COMMON),
    "qwen3-8b": ModelConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                            **_QWEN3_COMMON),
    # a mixture of experts: 6 experts, 2 per token, the first layer dense (as `mlp_only_layers` allows)
    "tiny-moe": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            max_position_embeddings=4096, rope_theta=10_000.0, eos_token_id=1,
                            num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                            mlp_only_layers=(0,)),
    "qwen3-30b-a3b": ModelConfig(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                 num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False,
                                 num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                 norm_topk_prob=True, **_QWEN3_COMMON),
}


def resolve_model(model: str) -> tuple[ModelConfig, Path | None]:
    """`model` is a preset name or a directory holding `config.json` (and maybe `*.safetensors`).
    Returns the config and the directory to load weights from (None: random weights, for a directory with no
    weight files at all; one with only pickled weights is refused)."""
    if model in PRESETS:
        return PRESETS[model], None
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory "
                         "with a config.json")
    config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    if any(path.glob("*.safetensors")):
        return config, path
    if others := sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth") for p in path.glob(pattern)):
        raise ValueError(f"model: {model!r} holds {others[0]} but no *.safetensors: tandem loads safetensors only "
                         "(save them with safetensors, e.g. model.save_pretrained(dir, safe_serialization=True))")
    return config, None
