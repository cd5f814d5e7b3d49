"""Typed configuration shared by every role. Importable without torch.

`EngineConfig` holds the engine's knobs; `RunConfig` everything `tandem run` needs; a model's shape (`ModelConfig`,
the presets, `resolve_model`) lives in `tandem.model_config` and is re-exported here. Each field's annotation is its
contract, checked when the config is made (`tandem.config_checks`): a value that breaks it raises `ValueError`
naming `section.field`.
"""

from __future__ import annotations

import dataclasses
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
from tandem.model_config import PRESETS, Dtype, ModelConfig, resolve_model  # noqa: F401 (re-exported)

# ---- the choices, each declared once (their tuples via get_args) ----------------------------------------------
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[PauseMode, ...] = get_args(PauseMode)
Placement = Literal["auto", "colocated", "separate", "disaggregated", "ray"]
WeightTransport = Literal["auto", "group", "ipc"]
BatchOrder = Literal["deadline", "admission"]
Advantage = Literal["grpo", "rloo"]
BehavMode = Literal["truncate", "mask"]
Aggregation = Literal["token_mean", "seq_mean"]
HostCache = Literal["off", "write_through", "write_back"]
HostCacheCopy = Literal["staged", "staged_kernels", "direct"]
WatchdogAction = Literal["wait", "abort"]
Role = Literal["unified", "prefill", "decode"]
RunDtype = Literal["float32", "bfloat16"]  # what an RL run computes in (float16 would need loss scaling)


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
    # how the tier's copies move pages on CUDA: "direct" (one kernel launch a copy, straight between pool and pinned
    # host pages on the compute stream; BENCHMARKS.md compares the three), "staged" (a gather or scatter on
    # the device, a bus transfer per run of host pages between staging and the host) or "staged_kernels" (the same
    # halves, each one kernel launch): `tandem.engine.host_moves`; a CPU pool always copies with torch
    host_cache_copy: HostCacheCopy = "direct"
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
    # with fused_kernels, steps of at most 16 rows on one rank through projections with their norms, residual adds,
    # SiLU and q/k norm + RoPE fused in (`tandem.kernels.small_linear`)
    small_batch_kernels: bool = True
    # a decode server's KV transfer by reference on CUDA: its pass (the copy, both checksums, their way to the host)
    # replayed as a CUDA graph per page-count bucket, one launch instead of four (`tandem.engine.kv_pass_graph`)
    kv_pass_graphs: bool = False
    # a decode server's KV transfer by reference on CUDA, with the prefill server's mail: its pass queued as the
    # pages mail lands, behind a wait on a doorbell the prefill engine rings once the KV is complete
    # (`tandem.engine.doorbell`, `EngineCore.arm_reserved`); where the device has none, the mail's way
    kv_doorbells: bool = True
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
    Placement: "auto" (the default) is "separate" when the trainer and the engine are both on CUDA (one GPU or two:
    in a process of its own the engine's host work does not wait for the trainer's Python to let go of the
    interpreter; BENCHMARKS.md, one-GPU handover, compares the two) or engine replicas are asked for, else
    "colocated"; `__post_init__` decides it. "colocated" runs the engine in a thread of the trainer's process,
    weights handed over in memory (CPU development: one process fewer); "separate" runs the engine in a process of
    its own behind its HTTP server; "disaggregated" a prefill server and a decode server, each in a process of its
    own, behind a router in the trainer's process (weights by ipc to both); "ray" the trainer and
    `rollout.num_engines` engine replicas as Ray actors (`tandem.run.ray_placement`). With several engines
    (`rollout.num_engines`, or `rollout.restart_engines`) "separate" and "ray" run replicas behind a router in the
    trainer's process, all updated by one broadcast over a group (`tandem.run.replicas`).
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
    placement: Placement = "auto"
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
        if self.placement == "auto":
            on_cuda = trainer.startswith("cuda") and engine.startswith("cuda")
            replicas = self.rollout.num_engines > 1 or self.rollout.restart_engines
            self.placement = "separate" if on_cuda or replicas else "colocated"
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
