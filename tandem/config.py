"""Typed configuration shared by every role. Importable without torch.

`ModelConfig` reads a Hugging Face `config.json` (Qwen3 dense); `EngineConfig` holds the engine's knobs.
User mistakes raise `ValueError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[PauseMode, ...] = get_args(PauseMode)


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
    num_pages: int = 512  # KV pool size; 0: size it from free GPU memory (kv_memory_fraction of it)
    kv_memory_fraction: float = 0.8
    max_running_requests: int = 64
    # per-step token budget for prefill chunks (chunked prefill); 512 suits a CPU (engine_throughput.py: 8192 on GPU)
    max_prefill_tokens: int = 512
    # while requests decode, hold new admissions back up to this many steps, so that several prefills share one
    # step (a step that prefills costs more than a decode-only one; not shown to help yet); 0: at once
    prefill_delay_steps: int = 0
    max_batch_requests: int = 256  # largest batch a single /generate may carry
    max_context_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_cache: bool = True
    # KV reuse across weight updates: 0 empties the prefix cache at every update; N keeps KV up to N updates old
    # (the async loop's prefill then skips what the update would have recomputed; see tandem.engine.engine)
    prefix_cache_max_age: int = 0
    # host tier under the prefix cache: "off", "write_through" (back up pages as the cache takes them) or
    # "write_back" (back up as they are evicted); host_cache_pages 0: twice the device pool
    host_cache: str = "off"
    host_cache_pages: int = 0
    device: str = "cpu"
    cuda_graphs: bool = True  # decode steps replay CUDA graphs (CUDA only; captured at start-up)
    # steps that prefill replay CUDA graphs too, up to this many tokens (padded up a ladder of sizes; eager, such
    # steps are launch-bound); 0: they run eagerly
    prefill_graph_max_tokens: int = 4096
    overlap: bool = True  # schedule and launch step n+1 before reading step n's tokens (see model_runner)
    fused_kernels: bool = True  # on CUDA: Triton attention kernels, fused RMSNorm/RoPE/SiLU (off: PyTorch)
    # tensor parallelism: rank 0's sampled tokens replace every rank's (turning it off risks divergence), and
    # a per-step digest comparison stops the engine when ranks disagree
    token_broadcast: bool = True
    lockstep_sentinel: bool = True
    # hang forensics: each rank's flight recorder journals to dump_dir (None: memory only, dumps need a
    # directory); the watchdog dumps when the engine loop makes no progress for watchdog_timeout_s (0: off),
    # then keeps waiting ("wait") or exits the process ("abort")
    dump_dir: str | None = None
    watchdog_timeout_s: float = 300.0
    watchdog_action: str = "wait"
    seed: int = 0  # seeds requests that carry no seed of their own

    def __post_init__(self):
        if self.num_pages < 0:
            raise ValueError(f"engine config: num_pages must be >= 0 (0 = size from GPU memory), got {self.num_pages}")
        if not 0 < self.kv_memory_fraction < 1:
            raise ValueError(f"engine config: kv_memory_fraction must be in (0, 1), got {self.kv_memory_fraction}")
        for name in ("page_size", "max_running_requests", "max_prefill_tokens", "max_batch_requests"):
            if getattr(self, name) <= 0:
                raise ValueError(f"engine config: {name} must be positive, got {getattr(self, name)}")
        if self.prefill_graph_max_tokens < 0:
            raise ValueError(f"engine config: prefill_graph_max_tokens must be >= 0, got "
                             f"{self.prefill_graph_max_tokens}")
        if not isinstance(self.prefill_delay_steps, int) or self.prefill_delay_steps < 0:
            raise ValueError(f"engine config: prefill_delay_steps must be an integer >= 0, got "
                             f"{self.prefill_delay_steps!r}")
        if self.max_context_len is not None and self.max_context_len <= 0:
            raise ValueError(f"engine config: max_context_len must be positive, got {self.max_context_len}")
        if self.host_cache not in ("off", "write_through", "write_back"):
            raise ValueError("engine config: host_cache must be off, write_through or write_back, got "
                             f"{self.host_cache!r}")
        if self.host_cache != "off" and not self.enable_prefix_cache:
            raise ValueError("engine config: host_cache needs enable_prefix_cache")
        if not isinstance(self.prefix_cache_max_age, int) or self.prefix_cache_max_age < 0:
            raise ValueError(f"engine config: prefix_cache_max_age must be an integer >= 0, got "
                             f"{self.prefix_cache_max_age!r}")
        if self.host_cache_pages < 0:
            raise ValueError(f"engine config: host_cache_pages must be >= 0, got {self.host_cache_pages}")


@dataclass(frozen=True, slots=True)
class LossConfig:
    """Knobs of every loss. `eps_low` / `eps_high`: PPO clip range [1 - eps_low, 1 + eps_high] (DAPO's clip-higher
    when eps_high > eps_low). `behav_cap` / `behav_mode`: decoupled PPO's cap on the behaviour weight, and whether a
    token above it is clamped to the cap ("truncate") or dropped from the numerator ("mask", AReaL's choice; the
    token still counts in the denominator). `tis_cap`: truncated importance sampling's cap. A cap of `math.inf`
    disables it. `kl_coef`: weight of the k3 KL penalty to the reference policy (needs `ref_logprobs`)."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    behav_cap: float = 5.0
    behav_mode: Literal["truncate", "mask"] = "truncate"
    tis_cap: float = 2.0
    kl_coef: float = 0.0
    aggregation: Literal["token_mean", "seq_mean"] = "token_mean"

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"loss config: {name} {why}, got {getattr(self, name)!r}")

        for name in ("eps_low", "eps_high", "behav_cap", "tis_cap", "kl_coef"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
                bad(name, "must be a number")
        if not 0 <= self.eps_low < 1:
            bad("eps_low", "must be in [0, 1)")
        if not 0 <= self.eps_high < math.inf:
            bad("eps_high", "must be finite and >= 0")
        # A cap below 1 would down-weight tokens that are exactly on-policy (w = 1).
        for name in ("behav_cap", "tis_cap"):
            if getattr(self, name) < 1:
                bad(name, "must be >= 1 (math.inf disables it)")
        if not 0 <= self.kl_coef < math.inf:
            bad("kl_coef", "must be finite and >= 0")
        if self.behav_mode not in ("truncate", "mask"):
            bad("behav_mode", "must be 'truncate' or 'mask'")
        if self.aggregation not in ("token_mean", "seq_mean"):
            bad("aggregation", "must be 'token_mean' or 'seq_mean'")


def _check_positive(section: str, obj, names) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"{section}.{name}: must be positive, got {value!r}")


@dataclass(slots=True)
class RandomAgentConfig:
    """The random agent: random prompts, a random number of turns, long-tailed response lengths (log-normal,
    clipped: most short, a few very long), random tool output of `obs_ratio` x the response length, optional
    simulated tool latency, and a reward uniform in [-1, 1]. Token ids are drawn from [0, vocab_size)."""

    prompt_len_min: int = 16
    prompt_len_max: int = 128
    turns_min: int = 1
    turns_max: int = 4
    response_len_median: float = 12.0
    response_len_sigma: float = 1.0  # log-normal sigma: 1.0 puts ~5% of turns above 5x the median
    response_len_max: int = 256
    obs_ratio: float = 3.0
    obs_len_max: int = 256
    tool_latency_s: float = 0.0  # mean of an exponential delay before each observation
    max_context: int = 2048

    def __post_init__(self):
        _check_positive("random_agent", self, ("prompt_len_min", "prompt_len_max", "turns_min", "turns_max",
                                               "response_len_median", "response_len_max", "max_context"))
        if self.prompt_len_max < self.prompt_len_min or self.turns_max < self.turns_min:
            raise ValueError("random_agent: *_max must be >= *_min")
        if self.response_len_sigma < 0 or self.obs_ratio < 0 or self.tool_latency_s < 0 or self.obs_len_max < 0:
            raise ValueError("random_agent: response_len_sigma, obs_ratio, obs_len_max and tool_latency_s "
                             "must be >= 0")
        if self.prompt_len_max >= self.max_context:
            raise ValueError(f"random_agent.max_context: must exceed prompt_len_max ({self.prompt_len_max}), "
                             f"got {self.max_context}")


@dataclass(slots=True)
class RolloutConfig:
    """The rollout manager. `max_staleness`: a token is trained at most this many versions after the one
    its episode started under (0 = on-policy; that is synchronous RL). `batch_groups` groups of
    `group_size` episodes make one train batch. `batch_order`: "deadline" fills each batch with the finished
    groups due soonest, so short episodes overtake long ones within the bound; "admission" trains groups in the
    order they were admitted (see `tandem.rollout.manager`)."""

    group_size: int = 4
    batch_groups: int = 4
    max_staleness: int = 2
    num_in_flight: int = 48  # episodes generating at once (slots); admission also obeys max_staleness
    temperature: float = 1.0
    top_p: float = 1.0
    pause_mode: Literal["abort", "retract", "in_place"] = "retract"
    batch_order: Literal["deadline", "admission"] = "deadline"

    def __post_init__(self):
        _check_positive("rollout", self, ("group_size", "batch_groups", "num_in_flight", "temperature", "top_p"))
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness: must be an integer >= 0, got {self.max_staleness!r}")
        if self.num_in_flight < self.group_size:
            raise ValueError(f"rollout.num_in_flight: must hold at least one group ({self.group_size}), "
                             f"got {self.num_in_flight}")
        if self.pause_mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"rollout.pause_mode: must be abort, retract or in_place, got {self.pause_mode!r}")
        if self.batch_order not in ("deadline", "admission"):
            raise ValueError(f"rollout.batch_order: must be deadline or admission, got {self.batch_order!r}")


@dataclass(slots=True)
class TrainerConfig:
    """`param_dtype`: the dtype forward and backward compute in; with "bfloat16" the optimizer still steps float32
    master weights. `activation_checkpointing`: recompute each decoder layer in the backward pass (less memory,
    about one more forward). `fsdp`: shard the model with FSDP2 over all ranks of the initialised default process
    group, each rank training on its share of every batch. `compile`: on CUDA without FSDP, each decoder layer's
    regions around attention through `torch.compile` (`Qwen3ForCausalLM.compile_layers`; the first steps compile,
    for seconds). `fused_kernels` (when not compiling): on CUDA without FSDP, RMSNorm, RoPE and SiLU-and-multiply
    through Triton kernels with backward passes (`tandem.kernels.training`); off by default, as their launches cost
    the host more than they save the device (a 0.6B step on an H200: compiled 137 ms, eager 163 ms, these 201 ms)."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_tokens: int = 4096  # micro-batches are packed up to this many tokens; gradients accumulate
    advantage: Literal["grpo", "rloo"] = "grpo"
    loss: str = "decoupled_ppo"  # a name in tandem.trainer.losses.LOSSES
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    activation_checkpointing: bool = False
    fsdp: bool = False
    compile: bool = True
    fused_kernels: bool = False

    def __post_init__(self):
        _check_positive("trainer", self, ("lr", "grad_clip", "micro_batch_tokens"))
        if self.advantage not in ("grpo", "rloo"):
            raise ValueError(f"trainer.advantage: must be grpo or rloo, got {self.advantage!r}")
        if self.param_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"trainer.param_dtype: must be float32 or bfloat16, got {self.param_dtype!r}")
        for name in ("activation_checkpointing", "fsdp", "compile", "fused_kernels"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"trainer.{name}: must be true or false, got {getattr(self, name)!r}")


@dataclass(slots=True)
class RunConfig:
    """Everything `tandem run` needs. The embedded default: the random agent on the tiny model, on CPU.

    Placement: "colocated" runs the engine in a thread of the trainer's process, weights handed over in memory;
    "separate" runs the engine in a process of its own behind its HTTP server. Its weights, by `weight_transport`:
    "group", broadcast over a torch.distributed group (NCCL when the trainer is on CUDA, else gloo) in buckets of
    `weight_bucket_bytes`; "ipc", handed over by reference through the pipe to the engine's process (CUDA IPC, or
    shared memory on a CPU), for an engine on the trainer's GPU; "auto" (default): ipc when both are on the same
    GPU, else group.
    The trainer runs on `trainer_device` (None: `engine.device`), the engine on `engine.device`.
    `weight_sync_timeout_s` bounds every collective of a weight sync (and joining the group); `engine_timeout_s`
    bounds the separate engine's start-up, every HTTP call but a generate, and how long it may leave `/health`
    unanswered."""

    model: str = "tiny"
    task: str = "random"  # random | target_tokens | guess_number
    steps: int = 20
    seed: int = 0
    out_dir: str = "runs/latest"
    checkpoint_every: int = 0  # 0: only at the end (and on Ctrl-C)
    resume: bool = False
    tensorboard: bool = False  # also write scalars for TensorBoard to out_dir (needs the tensorboard package)
    compare_sync: bool = False  # afterwards, run synchronous RL (max_staleness 0) on the same seed and compare
    placement: Literal["colocated", "separate"] = "colocated"
    trainer_device: str | None = None
    engine_dtype: Literal["float32", "bfloat16"] = "float32"  # the engine's weights and KV (the trainer's: trainer)
    weight_transport: Literal["auto", "group", "ipc"] = "auto"
    weight_bucket_bytes: int = 512 << 20
    weight_sync_timeout_s: float = 120.0
    engine_timeout_s: float = 300.0
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    loss: LossConfig = dataclasses.field(default_factory=lambda: LossConfig())
    random_agent: RandomAgentConfig = dataclasses.field(default_factory=RandomAgentConfig)

    def __post_init__(self):
        _check_positive("run", self, ("steps", "weight_bucket_bytes", "weight_sync_timeout_s", "engine_timeout_s"))
        if self.task not in ("random", "target_tokens", "guess_number"):
            raise ValueError(f"run.task: must be random, target_tokens or guess_number, got {self.task!r}")
        if self.engine_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"run.engine_dtype: must be float32 or bfloat16, got {self.engine_dtype!r}")
        if self.placement not in ("colocated", "separate"):
            raise ValueError(f"run.placement: must be colocated or separate, got {self.placement!r}")
        if self.trainer_device is not None and not isinstance(self.trainer_device, str):
            raise ValueError(f"run.trainer_device: must be a device name such as cuda:0, got {self.trainer_device!r}")
        trainer, engine = self.trainer_device or self.engine.device, self.engine.device
        if self.placement == "separate" and trainer.startswith("cuda") != engine.startswith("cuda"):
            raise ValueError(f"run.trainer_device: with placement separate the trainer ({trainer}) and the engine "
                             f"({engine}) must both be on CUDA (NCCL) or both on the CPU (gloo)")
        if self.weight_transport not in ("auto", "group", "ipc"):
            raise ValueError(f"run.weight_transport: must be auto, group or ipc, got {self.weight_transport!r}")
        if self.weight_transport != "auto" and self.placement != "separate":
            raise ValueError(f"run.weight_transport: {self.weight_transport} is for placement separate (colocated "
                             "hands weights over in memory)")
        if self.placement == "separate" and self.resolved_weight_transport == "group" and self._one_gpu:
            raise ValueError(f"run.weight_transport: group needs two GPUs (NCCL takes one per rank), got {trainer} "
                             "for the trainer and the engine; use ipc (the default on one GPU)")
        if self.resolved_weight_transport == "ipc" and trainer.startswith("cuda") and not self._one_gpu:
            raise ValueError(f"run.weight_transport: ipc needs the trainer ({trainer}) and the engine ({engine}) on "
                             "the same device")

    @property
    def _one_gpu(self) -> bool:
        """Trainer and engine on the same CUDA device."""
        trainer, engine = self.trainer_device or self.engine.device, self.engine.device
        return engine.startswith("cuda") and trainer.removesuffix(":0") == engine.removesuffix(":0")

    @property
    def resolved_weight_transport(self) -> str:
        """`weight_transport` with "auto" decided: ipc when trainer and engine share one GPU, else group."""
        if self.weight_transport != "auto":
            return self.weight_transport
        return "ipc" if self._one_gpu else "group"

    @classmethod
    def load(cls, path: str | None = None, overrides: list[str] = ()) -> RunConfig:
        """From a TOML file (sections named like the fields) and `section.key=value` overrides (values parsed
        as TOML: numbers, booleans, quoted or bare strings)."""
        import tomllib

        data: dict = {}
        if path:
            data = tomllib.loads(Path(path).read_text())
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ValueError(f"override {item!r}: expected section.key=value")
            try:
                value = tomllib.loads(f"v = {raw}")["v"]
            except tomllib.TOMLDecodeError:
                value = raw
            *sections, leaf = key.split(".")
            node = data
            for section in sections:
                node = node.setdefault(section, {})
            node[leaf] = value
        return _build(cls, data, "run")


def _build(cls, data: dict, where: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ValueError(f"{where}: unknown field {key!r}; known: {sorted(fields)}")
        sub = fields[key].default_factory if fields[key].default_factory is not dataclasses.MISSING else None
        sub_cls = type(sub()) if sub else None
        if sub_cls is not None and dataclasses.is_dataclass(sub_cls):
            if not isinstance(value, dict):
                raise ValueError(f"{where}.{key}: must be a section")
            kwargs[key] = _build(sub_cls, value, key)
        else:
            kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None
