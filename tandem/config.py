"""Typed configuration shared by every role. Importable without torch.

`ModelConfig` reads a Hugging Face `config.json` (Qwen3 dense); `EngineConfig` holds the engine's knobs.
User mistakes raise `ValueError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 40960
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    eos_token_id: int | None = None
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("model config: num_attention_heads must be a multiple of num_key_value_heads, "
                             f"got {self.num_attention_heads} and {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"model config: dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        """Build from a Hugging Face Qwen3 `config.json` dict (transformers 4.x `rope_theta` or 5.x
        `rope_parameters`). Unknown keys are ignored."""
        archs = d.get("architectures") or ["Qwen3ForCausalLM"]
        if d.get("model_type", "qwen3") != "qwen3" or "Qwen3ForCausalLM" not in archs:
            raise ValueError(f"model config: only Qwen3ForCausalLM (model_type qwen3) is supported, got "
                             f"model_type={d.get('model_type')!r} architectures={archs}")
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
            eos_token_id=eos, dtype=dtype,
        )

    def to_hf_dict(self) -> dict:
        """The `config.json` Hugging Face would write for this shape."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "dtype"}
        d.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
                 attention_bias=False, torch_dtype=self.dtype)
        return d

    def with_(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# Named shapes. "tiny" is for tests and the CPU demo; the others match the published Qwen3 configs.
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
}


def resolve_model(model: str) -> tuple[ModelConfig, Path | None]:
    """`model` is a preset name or a directory holding `config.json` (and maybe `*.safetensors`).
    Returns the config and the directory to load weights from (None: random weights)."""
    if model in PRESETS:
        return PRESETS[model], None
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory "
                         "with a config.json")
    config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    has_weights = any(path.glob("*.safetensors"))
    return config, (path if has_weights else None)


@dataclass(slots=True)
class EngineConfig:
    """Engine knobs. Sizes are in tokens unless named otherwise."""

    page_size: int = 16
    num_pages: int = 512  # KV pool size; the GPU path sizes it from free memory instead
    max_running_requests: int = 64
    max_prefill_tokens: int = 512  # per-step token budget for prefill chunks (chunked prefill)
    max_batch_requests: int = 256  # largest batch a single /generate may carry
    max_context_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_cache: bool = True
    device: str = "cpu"
    seed: int = 0  # seeds requests that carry no seed of their own

    def __post_init__(self):
        for name in ("page_size", "num_pages", "max_running_requests", "max_prefill_tokens",
                     "max_batch_requests"):
            if getattr(self, name) <= 0:
                raise ValueError(f"engine config: {name} must be positive, got {getattr(self, name)}")
        if self.max_context_len is not None and self.max_context_len <= 0:
            raise ValueError(f"engine config: max_context_len must be positive, got {self.max_context_len}")
