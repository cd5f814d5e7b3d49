"""Typed configuration shared by every role. Importable without torch.

`ModelConfig` reads a Hugging Face `config.json` (Qwen3 dense or Qwen3-MoE); `EngineConfig` holds the engine's
knobs; `RunConfig` everything `tandem run` needs. Each field's annotation is its contract, checked when the config is
made (`tandem.config_checks`): a value that breaks it raises `ValueError` naming `section.field`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, get_args

from tandem.config_checks import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Range,
    check_fields,
    field_hints,
)

# ---- the choices, each declared once (their tuples via get_args) ----------------------------------------------
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[PauseMode, ...] = get_args(PauseMode)
Placement = Literal["colocated", "separate", "disaggregated", "ray"]
WeightTransport = Literal["auto", "group", "ipc"]
BatchOrder = Literal["deadline", "admission"]
Advantage = Literal["grpo", "rloo"]
BehavMode = Literal["truncate", "mask"]
Aggregation = Literal["token_mean", "seq_mean"]
HostCache = Literal["off", "write_through", "write_back"]
WatchdogAction = Literal["wait", "abort"]
Role = Literal["unified", "prefill", "decode"]
Dtype = Literal["float32", "bfloat16", "float16"]
RunDtype = Literal["float32", "bfloat16"]  # what an RL run computes in (float16 would need loss scaling)


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


@dataclass(slots=True)
class EngineConfig:
    """Engine knobs. Sizes are in tokens unless named otherwise."""

    page_size: PositiveInt = 16
    num_pages: NonNegativeInt = 512  # KV pool size; 0: size it from free GPU memory (kv_memory_fraction of it)
    kv_memory_fraction: Annotated[float, Range(gt=0, lt=1)] = 0.8
    max_running_requests: PositiveInt = 64
    max_prefill_tokens: PositiveInt = 512  # per-step token budget for prefill chunks (chunked prefill)
    max_batch_requests: PositiveInt = 256  # largest batch a single /generate may carry
    max_context_len: PositiveInt | None = None  # default: the model's max_position_embeddings
    enable_prefix_cache: bool = True
    # KV reuse across weight updates: 0 empties the prefix cache at every update; N keeps KV up to N updates old
    # (the async loop's prefill then skips what the update would have recomputed; see tandem.engine.core)
    prefix_cache_max_age: NonNegativeInt = 0
    # host tier under the prefix cache: "off", "write_through" (back up pages as the cache takes them) or
    # "write_back" (back up as they are evicted); host_cache_pages 0: twice the device pool
    host_cache: HostCache = "off"
    host_cache_pages: NonNegativeInt = 0
    device: str = "cpu"
    cuda_graphs: bool = True  # decode steps replay CUDA graphs (CUDA only; captured at start-up)
    # steps that prefill replay CUDA graphs too, up to this many tokens (padded up a ladder of sizes; eager, such
    # steps are launch-bound); 0: they run eagerly
    prefill_graph_max_tokens: NonNegativeInt = 4096
    overlap: bool = True  # schedule and launch step n+1 before reading step n's tokens (see model_runner)
    # count the elements of a fixed-buffer replay's inputs that change while it runs (on the device, no host sync;
    # `ModelRunner.guard.count()`); a debugging aid, see docs/streams.md
    race_guard: bool = False
    fused_kernels: bool = True  # on CUDA: Triton attention kernels, fused RMSNorm/RoPE/SiLU (off: PyTorch)
    # tensor parallelism: rank 0's sampled tokens replace every rank's (turning it off risks divergence), and
    # a per-step digest comparison stops the engine when ranks disagree
    token_broadcast: bool = True
    lockstep_sentinel: bool = True
    # hang forensics: each rank's flight recorder journals to dump_dir (None: memory only, dumps need a
    # directory); the watchdog dumps when the engine loop makes no progress for watchdog_timeout_s (0: off),
    # then keeps waiting ("wait") or exits the process ("abort")
    dump_dir: str | None = None
    watchdog_timeout_s: NonNegativeFloat = 300.0
    watchdog_action: WatchdogAction = "wait"
    seed: int = 0  # seeds requests that carry no seed of their own
    # a measurement (benchmarks, the run's table): count what an ideal, unbounded prefix cache would have served
    # (EngineStats.prompt_tokens_ideal); it costs a token tree beside the cache
    measure_ideal_reuse: bool = False
    # prefill/decode disaggregation (`tandem.server.disagg`): a prefill server's engine computes prompts for decode
    # servers; a decode server's takes their KV, and hands a request it retracts for a weight update back to be
    # prefilled again (`EngineCore`)
    role: Role = "unified"
    # rollout routing replay: keep every computed token's top-k experts of every layer beside its KV (slot by slot;
    # moved with it through the host tier and between prefill and decode servers), so a request can ask for them
    # (`return_routed_experts`); a mixture-of-experts model only
    enable_return_routed_experts: bool = False

    def __post_init__(self):
        check_fields(self)
        if self.host_cache != "off" and not self.enable_prefix_cache:
            raise ValueError(f"engine.host_cache: {self.host_cache} needs enable_prefix_cache")


@dataclass(frozen=True, slots=True)
class LossConfig:
    """Knobs of every loss. `eps_low` / `eps_high`: PPO clip range [1 - eps_low, 1 + eps_high] (DAPO's clip-higher
    when eps_high > eps_low). `behav_cap` / `behav_mode`: decoupled PPO's cap on the behaviour weight, and whether a
    token above it is clamped to the cap ("truncate") or dropped from the numerator ("mask", AReaL's choice; the
    token still counts in the denominator). `tis_cap`: truncated importance sampling's cap. A cap of `math.inf`
    disables it. `kl_coef`: weight of the k3 KL penalty to the reference policy (needs `ref_logprobs`)."""

    eps_low: Annotated[float, Range(ge=0, lt=1)] = 0.2
    eps_high: Annotated[float, Range(ge=0, lt=math.inf)] = 0.2
    # a cap below 1 would down-weight tokens that are exactly on-policy (w = 1)
    behav_cap: Annotated[float, Range(ge=1)] = 5.0
    behav_mode: BehavMode = "truncate"
    tis_cap: Annotated[float, Range(ge=1)] = 2.0
    kl_coef: Annotated[float, Range(ge=0, lt=math.inf)] = 0.0
    aggregation: Aggregation = "token_mean"

    def __post_init__(self):
        check_fields(self)


@dataclass(slots=True)
class RandomAgentConfig:
    """The random agent: random prompts, a random number of turns, long-tailed response lengths (log-normal,
    clipped: most short, a few very long), random tool output of `obs_ratio` x the response length, optional
    simulated tool latency, and a reward uniform in [-1, 1]. Token ids are drawn from [0, vocab_size)."""

    prompt_len_min: PositiveInt = 16
    prompt_len_max: PositiveInt = 128
    turns_min: PositiveInt = 1
    turns_max: PositiveInt = 4
    response_len_median: PositiveFloat = 12.0
    response_len_sigma: NonNegativeFloat = 1.0  # log-normal sigma: 1.0 puts ~5% of turns above 5x the median
    response_len_max: PositiveInt = 256
    obs_ratio: NonNegativeFloat = 3.0
    obs_len_max: NonNegativeInt = 256
    tool_latency_s: NonNegativeFloat = 0.0  # mean of an exponential delay before each observation
    max_context: PositiveInt = 2048

    def __post_init__(self):
        check_fields(self)
        for low, high in (("prompt_len_min", "prompt_len_max"), ("turns_min", "turns_max")):
            if getattr(self, high) < getattr(self, low):
                raise ValueError(f"random_agent.{high}: must be >= {low} ({getattr(self, low)}), "
                                 f"got {getattr(self, high)}")
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

    group_size: PositiveInt = 4
    batch_groups: PositiveInt = 4
    max_staleness: NonNegativeInt = 2
    num_in_flight: PositiveInt = 48  # episodes generating at once (slots); admission also obeys max_staleness
    temperature: PositiveFloat = 1.0
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
    pause_mode: PauseMode = "retract"
    batch_order: BatchOrder = "deadline"
    # engine replicas (placement separate or ray): each an engine server of its own behind one router (an episode
    # stays on one replica; a new one goes to the least loaded), all updated by one weight broadcast;
    # `restart_engines`: a replica that dies is restarted, rejoins the weight group and gets traffic once it holds
    # the current weights (without it the run goes on with the others, and fails when none is left)
    num_engines: PositiveInt = 1
    restart_engines: bool = False

    def __post_init__(self):
        check_fields(self)
        if self.num_in_flight < self.group_size:
            raise ValueError(f"rollout.num_in_flight: must hold at least one group ({self.group_size}), "
                             f"got {self.num_in_flight}")


@dataclass(slots=True)
class TrainerConfig:
    """`param_dtype`: the dtype forward and backward compute in; with "bfloat16" the optimizer still steps float32
    master weights. `activation_checkpointing`: recompute each decoder layer in the backward pass (less memory,
    about one more forward). `fsdp`: shard the model with FSDP2 over all ranks of the initialised default process
    group, each rank training on its share of every batch. `compile`: on CUDA without FSDP, each decoder layer's
    regions around attention through `torch.compile` (`tandem.trainer.trainer.compile_layers`: a mixture-of-experts
    layer's region after attention stays eager; the first steps compile).
    `fused_kernels` (when not compiling): on CUDA without FSDP, RMSNorm, RoPE and SiLU-and-multiply through Triton
    kernels with backward passes (`tandem.kernels.training`); off by default (BENCHMARKS.md: slower than compiling
    and than eager). `load_balancing_coef`: for a mixture-of-experts model, the weight of the routers'
    load-balancing loss added to the policy loss (`tandem.trainer.balance`; Hugging Face's `router_aux_loss_coef`);
    0 trains without it, and the step's stats report it either way. `routing_replay`: rollout routing replay (R3) for
    a mixture-of-experts model: every MoE layer sends each token to the experts the engine routed it to (recorded
    in its episode), weighted by the trainer's router (`tandem.trainer.replay`); tokens the engine never computed
    route live. In a run it has the engine keep its routing (`engine.enable_return_routed_experts`, which alone
    records the routing and reports the routing metrics without replaying it)."""

    lr: PositiveFloat = 1e-3
    weight_decay: NonNegativeFloat = 0.0
    grad_clip: PositiveFloat = 1.0
    micro_batch_tokens: PositiveInt = 4096  # micro-batches are packed up to this many tokens; gradients accumulate
    advantage: Advantage = "grpo"
    loss: str = "decoupled_ppo"  # a name in tandem.trainer.losses.LOSSES
    param_dtype: RunDtype = "float32"
    activation_checkpointing: bool = False
    fsdp: bool = False
    compile: bool = True
    fused_kernels: bool = False
    load_balancing_coef: NonNegativeFloat = 0.0
    routing_replay: bool = False
    # placement ray: the trainer's actors, FSDP2 over them (`fsdp`; one process trains otherwise)
    num_ranks: PositiveInt = 1
    # every N steps (and at the end) the run writes its policy as a Hugging Face checkpoint to
    # out_dir/exports/step_NNNNNN (`tandem.run.export`; 0: never, `tandem export` does it from the checkpoint)
    export_every: NonNegativeInt = 0

    def __post_init__(self):
        check_fields(self)


@dataclass(slots=True)
class RunConfig:
    """Everything `tandem run` needs. The embedded default: the random agent on the tiny model, on CPU.

    `task`: a registered task name or `package.module:factory` (checked by `tandem.rollout.registry`).
    Placement: "colocated" runs the engine in a thread of the trainer's process, weights handed over in memory;
    "separate" runs the engine in a process of its own behind its HTTP server; "disaggregated" a prefill server and a
    decode server, each in a process of its own, behind a router in the trainer's process (weights by ipc to both);
    "ray" the trainer and `rollout.num_engines` engine replicas as Ray actors (`tandem.run.ray_placement`). With
    several engines (`rollout.num_engines`, or `rollout.restart_engines`) "separate" and "ray" run replicas behind a
    router in the trainer's process, all updated by one broadcast over a group (`tandem.run.replicas`).
    The separate engine's weights, by `weight_transport`:
    "group", broadcast over a torch.distributed group (NCCL when the trainer is on CUDA, else gloo) in buckets of
    `weight_bucket_bytes`; "ipc", handed over by reference through the pipe to the engine's process (CUDA IPC, or
    shared memory on a CPU), for an engine on the trainer's GPU; "auto" (default): ipc when both are on the same
    GPU, else group.
    The trainer runs on `trainer_device` (None: `engine.device`), the engine on `engine.device`.
    `weight_sync_timeout_s` bounds every collective of a weight sync (and joining the group); `engine_timeout_s`
    bounds every HTTP call to the separate engine but a generate, and how long it may leave `/health` unanswered;
    `engine_start_timeout_s` its start-up (imports, weights, CUDA graph capture)."""

    model: str = "tiny"
    task: str = "random"
    steps: PositiveInt = 20
    seed: int = 0
    out_dir: str = "runs/latest"
    checkpoint_every: NonNegativeInt = 10  # steps between checkpoints (0: only at the end, on Ctrl-C and SIGTERM)
    resume: bool = False  # continue from out_dir's checkpoint (an error if there is none)
    tensorboard: bool = False  # also write scalars for TensorBoard to out_dir (needs the tensorboard package)
    wandb: bool = False  # also log scalars to Weights & Biases (needs the wandb package; WANDB_MODE=offline works)
    wandb_project: str = "tandem"
    compare_sync: bool = False  # afterwards, run synchronous RL (max_staleness 0) on the same seed and compare
    placement: Placement = "colocated"
    trainer_device: str | None = None
    engine_dtype: RunDtype = "float32"  # the engine's weights and KV (the trainer's: trainer.param_dtype)
    weight_transport: WeightTransport = "auto"
    weight_bucket_bytes: PositiveInt = 512 << 20
    weight_sync_timeout_s: PositiveFloat = 120.0
    engine_timeout_s: PositiveFloat = 300.0
    engine_start_timeout_s: PositiveFloat = 600.0
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    random_agent: RandomAgentConfig = dataclasses.field(default_factory=RandomAgentConfig)

    def __post_init__(self):
        check_fields(self)
        trainer, engine = self.trainer_device or self.engine.device, self.engine.device
        if self.placement == "separate" and trainer.startswith("cuda") != engine.startswith("cuda"):
            raise ValueError(f"run.trainer_device: with placement separate the trainer ({trainer}) and the engine "
                             f"({engine}) must both be on CUDA (NCCL) or both on the CPU (gloo)")
        if self.weight_transport != "auto" and self.placement == "colocated":
            raise ValueError(f"run.weight_transport: {self.weight_transport} is for placement separate (colocated "
                             "hands weights over in memory)")
        if self.placement == "disaggregated" and (self.weight_transport == "group" or trainer != engine):
            raise ValueError("run.placement: disaggregated hands weights to both servers by reference (ipc): the "
                             f"trainer ({trainer}) and the engine ({engine}) on one device, weight_transport auto "
                             "or ipc")
        if self.placement == "separate" and self.resolved_weight_transport == "group" and self._one_gpu:
            raise ValueError(f"run.weight_transport: group needs two GPUs (NCCL takes one per rank), got {trainer} "
                             "for the trainer and the engine; use ipc (the default on one GPU)")
        if self.resolved_weight_transport == "ipc" and trainer.startswith("cuda") and not self._one_gpu:
            raise ValueError(f"run.weight_transport: ipc needs the trainer ({trainer}) and the engine ({engine}) on "
                             "the same device")
        if (self.rollout.num_engines > 1 or self.rollout.restart_engines) and self.placement not in ("separate", "ray"):
            raise ValueError(f"rollout.num_engines: replicas (and restart_engines) need placement separate or ray, got "
                             f"{self.placement}")
        if self.placement == "ray" and self.resolved_weight_transport != "group":
            raise ValueError("run.weight_transport: placement ray broadcasts weights over a group (group or auto)")
        if self.placement == "ray" and (trainer.startswith("cuda") != engine.startswith("cuda")):
            raise ValueError(f"run.trainer_device: with placement ray the trainer ({trainer}) and the engines "
                             f"({engine}) must both be on CUDA (NCCL) or both on the CPU (gloo)")
        if self.replicas and self.resolved_weight_transport == "ipc":
            raise ValueError("run.weight_transport: replicas take one broadcast over a group, not ipc: give each "
                             "its own GPU (engine.device cuda:1 puts replica i on cuda:1+i)")
        if self.trainer.num_ranks > 1 and not (self.placement == "ray" and self.trainer.fsdp):
            raise ValueError(f"trainer.num_ranks: {self.trainer.num_ranks} trainer ranks need placement ray and "
                             "trainer.fsdp (other placements train in one process)")
        if self.trainer.routing_replay:
            self._keep_routing_for_replay()

    def _keep_routing_for_replay(self) -> None:
        """`trainer.routing_replay` replays what the engine records: have it record (refused where it cannot)."""
        if not resolve_model(self.model)[0].is_moe:
            raise ValueError(f"trainer.routing_replay: needs a mixture-of-experts model, {self.model!r} has no "
                             "expert layers")
        if self.placement == "disaggregated":
            raise ValueError("trainer.routing_replay: not yet with placement disaggregated (its servers keep the "
                             "routing, but a run through them is not yet tested)")
        self.engine = dataclasses.replace(self.engine, enable_return_routed_experts=True)

    @property
    def replicas(self) -> bool:
        """Whether the engines run as replicas behind a router (`tandem.run.replicas`)."""
        return self.placement == "ray" or (self.placement == "separate" and (self.rollout.num_engines > 1
                                                                             or self.rollout.restart_engines))

    @property
    def _one_gpu(self) -> bool:
        """Trainer and engine on the same CUDA device."""
        trainer, engine = self.trainer_device or self.engine.device, self.engine.device
        return engine.startswith("cuda") and trainer.removesuffix(":0") == engine.removesuffix(":0")

    @property
    def resolved_weight_transport(self) -> str:
        """`weight_transport` with "auto" decided: ipc when trainer and engine share one GPU (or the placement is
        disaggregated), else group."""
        if self.weight_transport != "auto":
            return self.weight_transport
        if self.placement in ("disaggregated", "ray"):
            return "ipc" if self.placement == "disaggregated" else "group"  # (ray: every actor has its own device)
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
    """`cls` from a TOML table: nested tables become the nested configs; unknown keys are an error."""
    hints = field_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in hints:
            raise ValueError(f"{where}: unknown field {key!r}; known: {sorted(hints)}")
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ValueError(f"{where}.{key}: must be a section, got {value!r}")
            value = _build(hints[key], value, key)
        kwargs[key] = value
    return cls(**kwargs)
