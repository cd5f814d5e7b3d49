"""The one vocabulary that crosses every boundary: sampling parameters, a generate request's output,
finish reasons. Plain dataclasses, importable without torch. Field names follow SGLang's native API."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. `temperature == 0` is greedy; otherwise it is at least `MIN_TEMPERATURE` (below it
    the scaled logits overflow). `top_k <= 0` and `top_p == 1` disable those filters. `seed` makes sampling
    reproducible: the same seed, prompt and weights give the same tokens whatever else is batched alongside (the
    noise is a function of seed and position only). Every integer is bounded so that it fits the engine's
    tensors; token ids are checked against the vocabulary when a request is submitted.

    `min_new_tokens`: EOS and `stop_token_ids` cannot be sampled before that many tokens. `top_logprobs_num`: each
    output token also returns that many most likely tokens and their logprobs (SGLang's top-level /generate
    field; the server puts it here). The engine itself ignores the rest, which the HTTP server's text layer
    (`tandem.server.text`) and fan-out apply: `stop` strings (a tokenizer decodes the output), `skip_special_tokens`,
    `spaces_between_special_tokens` and `no_stop_trim` for the returned text, `n` samples of one prompt."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    min_new_tokens: int = 0
    top_logprobs_num: int = 0
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"sampling_params.{name}: {why}, got {getattr(self, name)!r}")

        if not _is_int(self.max_new_tokens) or not 0 <= self.max_new_tokens < INT32:
            bad("max_new_tokens", "must be an integer in [0, 2**31)")
        t = self.temperature
        if not _is_number(t) or not (t == 0 or MIN_TEMPERATURE <= t < math.inf):
            bad("temperature", f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or not -INT32 <= self.top_k < INT32:
            bad("top_k", "must be an integer in [-2**31, 2**31) (<= 0 disables it)")
        if not _is_number(self.min_p) or not 0 <= self.min_p < 1:
            bad("min_p", "must be in [0, 1)")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a boolean")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens < INT32:
            bad("min_new_tokens", "must be an integer in [0, 2**31)")
        if not _is_int(self.top_logprobs_num) or not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS:
            bad("top_logprobs_num", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}]")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, tuple | list) or not all(isinstance(s, str) and s for s in stop):
            bad("stop", "must be a non-empty string or a list of them")
        object.__setattr__(self, "stop", tuple(stop))
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            bad("seed", "must be an integer in [0, 2**63)")
        ids = self.stop_token_ids
        if not isinstance(ids, tuple | list) or not all(_is_int(t) and 0 <= t < INT32 for t in ids):
            bad("stop_token_ids", "must be a list of integers in [0, 2**31)")
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        """From SGLang's `sampling_params` JSON object (every field SGLang documents is known; `sampling_seed` is
        SGLang's name for `seed`). Unknown keys are an error (a typo must not be silently ignored); `null` values
        mean the default. Fields of features tandem lacks (penalties, constrained decoding, logit bias) are refused
        naming the field unless they hold their default; `custom_params` and `stream_interval` are accepted and
        ignored (no custom logit processors; streams send every step's tokens)."""
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params: must be an object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} | set(_SGLANG_ONLY) | {"sampling_seed"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {unknown}; known: {sorted(known)}")
        given = {k: v for k, v in d.items() if v is not None and k not in _SGLANG_ONLY}
        for name, (check, why) in _SGLANG_ONLY.items():
            if d.get(name) is not None and not check(d[name]):
                raise ValueError(f"sampling_params.{name}: {why}, got {d[name]!r}")
        if given.get("sampling_seed") is not None:
            if given.get("seed", given["sampling_seed"]) != given["sampling_seed"]:
                raise ValueError("sampling_params.sampling_seed: SGLang's name for seed; send one of them, got "
                                 f"both ({d['sampling_seed']!r} and {d['seed']!r})")
            given["seed"] = given.pop("sampling_seed")
        if isinstance(given.get("stop_token_ids"), list):  # SGLang drops null entries
            given["stop_token_ids"] = [t for t in given["stop_token_ids"] if t is not None]
        return cls(**given)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


INT32 = 2**31
MIN_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 64
MAX_N = 64

_PENALTY = "tandem implements no penalties"
_CONSTRAINED = "tandem has no constrained decoding; send null"
# SGLang's sampling fields for features tandem lacks: each with the check its value must pass (null always does) and
# the rule a 400 quotes. `custom_params` (for custom logit processors, which tandem has none of) and
# `stream_interval` (streams send every step's tokens) are accepted and ignored.
_SGLANG_ONLY = {
    "frequency_penalty": (lambda v: _is_number(v) and v == 0, f"{_PENALTY}; send 0 (the default) or null"),
    "presence_penalty": (lambda v: _is_number(v) and v == 0, f"{_PENALTY}; send 0 (the default) or null"),
    "repetition_penalty": (lambda v: _is_number(v) and v == 1, f"{_PENALTY}; send 1 (the default) or null"),
    "json_schema": (lambda v: False, _CONSTRAINED),
    "regex": (lambda v: False, _CONSTRAINED),
    "ebnf": (lambda v: False, _CONSTRAINED),
    "structural_tag": (lambda v: False, _CONSTRAINED),
    "stop_regex": (lambda v: v in ("", []), "stop regexes are not supported (send stop strings); send null"),
    "logit_bias": (lambda v: v == {}, "logit bias is not supported; send null"),
    "custom_params": (lambda v: isinstance(v, dict), "must be an object (tandem ignores it: no custom logit "
                      "processors)"),
    "stream_interval": (lambda v: _is_int(v) and v >= 1, "must be a positive integer (tandem ignores it: streams "
                        "send every step's tokens)"),
}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x  # x == x rejects NaN


# The message of an abort caused by `pause("abort")`: such a request may be resubmitted to continue.
PAUSED_ABORT = "engine paused (mode abort)"
# The message of a decode server's request handed back to be prefilled again under new weights (a pause in mode
# retract, or KV of other weights): the server runs it through a prefill server again; no client sees it.
HANDED_BACK = "handed back to be prefilled again"


@dataclass(frozen=True, slots=True)
class FinishReason:
    type: Literal["length", "stop", "abort"]
    length: int | None = None  # for "length": the number of tokens generated
    matched: int | str | None = None  # for "stop": the stop/EOS token id, or the stop string, that ended it
    message: str | None = None  # for "abort": why

    def to_dict(self) -> dict:
        """SGLang's `meta_info.finish_reason` object."""
        d: dict = {"type": self.type}
        if self.type == "length":
            d["length"] = self.length
        elif self.type == "stop":
            d["matched"] = self.matched
        elif self.message:
            d["message"] = self.message
        return d


@dataclass(slots=True)
class GenerateOutput:
    """What a finished request returns. `output_logprobs[i]` is the log-probability of `output_ids[i]`
    under the distribution it was sampled from (see `tandem.engine.sampler`); `weight_versions[i]` is
    the weight version the engine held when it sampled `output_ids[i]`."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    weight_versions: list[int]
    finish_reason: FinishReason | None  # None: still running (a streamed request's progress)
    prompt_tokens: int
    # when the request was first admitted: prompt tokens served from the prefix cache, and how many of them were
    # loaded back from the host tier (the rest came from the device)
    cached_tokens: int
    host_cached_tokens: int = 0
    prefill_tokens: int = 0  # tokens this request actually computed in prefill, over all its admissions
    num_retractions: int = 0
    weight_version: int = 0  # the engine's weight version when the request finished
    kv: object = None  # on a prefill server, the KV it exports (`tandem.engine.kv_transfer.KVPages`)
    # when asked for: the top-k expert ids each MoE layer routed each computed token to, an int16 tensor
    # [len(prompt) + len(output) - 1, num_hidden_layers, num_experts_per_tok] (-1 in dense layers); the server
    # sends it as SGLang does (`meta_info.routed_experts`)
    routed_experts: object = None
    # when asked for (`SamplingParams.top_logprobs_num`): for each output token, the most likely tokens of the
    # distribution it was sampled from, as (logprob, token id) pairs, most likely first
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    text: str = ""  # the output decoded (the server's text layer fills it in when it has a tokenizer)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def meta_info(self, return_logprob: bool = False, token_texts: list[str] | None = None,
                  top_texts: list[list[str]] | None = None) -> dict:
        """SGLang's `meta_info` object; with `return_logprob`, `output_token_logprobs` as [logprob, token id, text]
        triples (the texts from `token_texts`, else null) and, when kept, `output_top_logprobs` (one list of such
        triples per output token; texts from `top_texts`)."""
        meta = {
            "id": self.rid,
            "finish_reason": self.finish_reason.to_dict() if self.finish_reason is not None else None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_tokens_details": {"device": self.cached_tokens - self.host_cached_tokens,
                                      "host": self.host_cached_tokens},
            "prefill_tokens": self.prefill_tokens,
            "num_retractions": self.num_retractions,
            "weight_version": self.weight_version,
            "output_token_weight_versions": self.weight_versions,
        }
        if return_logprob:
            texts = token_texts or [None] * len(self.output_ids)
            meta["output_token_logprobs"] = [[lp, t, s] for lp, t, s in zip(self.output_logprobs, self.output_ids,
                                                                             texts, strict=True)]
            meta["output_token_logprobs_length"] = len(self.output_ids)
            if self.output_top_logprobs is not None:
                tops = top_texts or [[None] * len(top) for top in self.output_top_logprobs]
                meta["output_top_logprobs"] = [[[lp, t, s] for (lp, t), s in zip(top, ts, strict=True)]
                                               for top, ts in zip(self.output_top_logprobs, tops, strict=True)]
        return meta


@dataclass(slots=True)
class TokenDelta:
    """Output tokens a running request sampled since an earlier delta (`Engine.watch`): `start` is the index of the
    first of them among the request's output tokens; the lists are parallel (`output_top_logprobs` when kept)."""

    rid: str
    start: int
    output_ids: list[int]
    output_logprobs: list[float]
    weight_versions: list[int]
    output_top_logprobs: list[list[tuple[float, int]]] | None = None


@dataclass(slots=True)
class EngineStats:
    """Counters the engine exposes (and `/metrics` exports)."""

    num_running: int = 0
    num_queued: int = 0
    num_paused: int = 0
    generated_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefill_tokens_cached: int = 0  # served from the prefix cache (device plus host tier), over all admissions
    prefill_tokens_host: int = 0  # of which loaded back from the host tier
    # on first admissions: prompt tokens, those served from the cache, those an ideal, unbounded cache would serve
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_ideal: int = 0
    ideal_measured: bool = False  # whether prompt_tokens_ideal is measured (EngineConfig.measure_ideal_reuse)
    num_retractions: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_steps: int = 0
    decode_steps: int = 0  # of which one token per request (decode: CUDA graphs on GPU); the rest prefill too
    running_request_steps: int = 0  # requests in each step, summed over steps (/ num_steps: the mean batch)
    waiting_request_steps: int = 0  # requests waiting for admission at each step, summed
    command_waits: int = 0  # commands that waited for the step in flight (the device then waits for the host)
    # steps or commands that held every request past `tandem.engine.core.SLOW_ITERATION_S` (each logged, with where
    # the engine's thread was held), and the longest of them
    slow_iterations: int = 0
    slowest_iteration_seconds: float = 0.0
    busy_seconds: float = 0.0  # time spent in steps
    idle_seconds: float = 0.0  # time with nothing to run (no requests, or paused); the rest: commands, the loop
    # where the busy time goes: scheduling, building the step's inputs on the host, the forward pass and
    # sampling (until the sampled ids reach the host), and bookkeeping after the step
    schedule_seconds: float = 0.0
    prepare_seconds: float = 0.0
    forward_seconds: float = 0.0
    postprocess_seconds: float = 0.0
    weight_version: int = 0
    pages_total: int = 0
    pages_free: int = 0
    pages_cached: int = 0  # pages held only by the prefix cache (evictable)
    host_pages_total: int = 0
    host_pages_free: int = 0
    host_pages_loaded: int = 0  # host-to-device copies, in pages
    host_pages_backed_up: int = 0  # device-to-host copies, in pages
    imports_recomputed: int = 0  # a decode server's imports whose KV it could not take (see `EngineCore`): recomputed

    @property
    def cache_hit_rate(self) -> float:
        total = self.prefill_tokens_computed + self.prefill_tokens_cached
        return self.prefill_tokens_cached / total if total else 0.0

    @property
    def recompute_vs_ideal(self) -> float:
        """Prefill tokens computed / those an ideal cache would compute (each prompt minus its ideal reuse); NaN
        unless the engine measures the ideal (`EngineConfig.measure_ideal_reuse`)."""
        ideal = self.prompt_tokens - self.prompt_tokens_ideal
        return (self.prefill_tokens_computed / ideal if ideal else 1.0) if self.ideal_measured else math.nan

    @property
    def reuse_vs_ideal(self) -> float:
        """Prompt tokens served from the cache / those an ideal cache would have served; NaN unless measured."""
        if not self.ideal_measured:
            return math.nan
        return self.prompt_tokens_cached / self.prompt_tokens_ideal if self.prompt_tokens_ideal else 1.0


@dataclass(slots=True)
class Episode:
    """One multi-turn episode, token by token. Parallel lists, one entry per token of `tokens`:
    `loss_mask` 1 for policy tokens the trainer learns from, 0 for environment tokens (prompt, tool output);
    `behav_logprobs` the engine's logprob for policy tokens (0.0 for environment tokens); `versions` the
    weight version a policy token was sampled under, -1 for environment tokens (so `versions[i] >= 0` says
    who produced token i). `routed_experts`, when the rollout kept the routing (`keep_routing`): the engine's top-k
    expert ids of every layer for each token, an int16 tensor [len(tokens), num_hidden_layers, num_experts_per_tok],
    -1 in dense layers and in the rows of tokens the engine never computed (the last one, tool output after the
    last turn); None: not kept."""

    episode_id: str
    group_id: int
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behav_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    start_version: int = 0  # the engine's weight version when the episode was admitted
    num_turns: int = 0
    num_resubmits: int = 0  # turns continued after an abort-mode pause (partial rollout stitched back)
    truncated: bool = False  # stopped by the context limit rather than by the environment
    routed_experts: object = None

    def add(self, tokens: list[int], policy: bool, logprobs: list[float] | None = None,
            versions: list[int] | None = None) -> None:
        self.tokens += tokens
        self.loss_mask += [int(policy)] * len(tokens)
        self.behav_logprobs += logprobs if policy else [0.0] * len(tokens)
        self.versions += versions if policy else [-1] * len(tokens)

    def keep_routing(self, rows=None) -> None:
        """Make `routed_experts` one row per token of `tokens`: `rows` (a generate's `routed_experts`: the rows of
        the first len(rows) tokens, as the engine computed them for its latest request) replace those tokens' rows;
        tokens no generate has computed get rows of -1. None: only extend the rows to the tokens added since."""
        known = [r for r in (self.routed_experts, rows) if r is not None]
        if not known:
            return
        full = known[0].new_full((len(self.tokens), *known[0].shape[1:]), -1)
        for r in known:  # the latest request's rows over the earlier ones
            n = min(len(r), len(full))
            full[:n] = r[:n]
        self.routed_experts = full

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass(slots=True)
class Group:
    """`n` episodes that share one prompt (GRPO's group). `index` is its admission number: the trainer's
    batch s is exactly groups s * B .. (s + 1) * B - 1, which is what bounds staleness."""

    index: int
    episodes: list[Episode]
    start_version: int
