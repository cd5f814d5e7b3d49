"""Policy losses: functions over one shared input type, chosen by name from `LOSSES`.

Contract of every loss: `fn(inp: LossInput, cfg: LossConfig) -> (loss, metrics)`, where `loss` is a scalar tensor
whose gradient flows only into `inp.logprobs` and `metrics` is a dict of Python floats. Inputs are flat packed
tokens [T]; only policy tokens (`loss_mask == 1`) count: environment tokens never change the loss, its gradient
or the metrics, whatever values they hold (NaN included). A loss never mutates its input. Maths runs in float32.

Three log-probabilities per token, from three policies:
  - `logprobs`: the current policy pi_theta (the trainer's forward pass, with grad);
  - `old_logprobs`: the proximal policy pi_prox, the trainer's recomputation with the weights before this update;
  - `behav_logprobs`: the behaviour policy pi_behav the engine sampled under (possibly several versions stale, and
    a different numeric implementation even when fresh).

Aggregation (`cfg.aggregation`):
  - "token_mean": sum of per-token losses over policy tokens / number of policy tokens (every token weighs the same,
    so long responses weigh more);
  - "seq_mean": the mean over policy tokens within each sequence of `inp.seq_lens`, then the mean over the
    sequences that have at least one policy token (every sequence weighs the same).
With no policy token at all the loss is 0 (still connected to the graph) and every metric is 0.

Metrics (token-level, over policy tokens, whatever the aggregation):
  - loss, pg_loss (the policy-gradient part alone), kl (mean k3 to the reference; only if `ref_logprobs` is given);
  - clip_frac: fraction of tokens whose PPO clip was active (the clipped term won the min, so zero gradient);
  - ratio_mean/min/max: exp(logprobs - old_logprobs);
  - behav_weight_mean/min/max: the raw behaviour weight w = exp(old_logprobs - behav_logprobs), before any cap;
  - ess: effective sample size of the raw behaviour weights, (sum w)^2 / (N * sum w^2), in (0, 1];
  - mismatch_kl: mean(behav_logprobs - old_logprobs), the k1 estimate of KL(pi_behav || pi_prox) (unbiased since
    the tokens were sampled from pi_behav; a single batch can give a small negative value);
  - mismatch_k3: mean(w - 1 - log w), the k3 estimate of the same KL (never negative, lower variance), and
    mismatch_ratio_beyond_2: the fraction of tokens whose w is above 2 or below 1/2 (R3's measures of the
    engine/trainer mismatch; both include staleness, as w does);
  - cap_frac (decoupled_ppo and tis only): fraction of tokens whose behaviour weight exceeded the cap;
  - num_policy_tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.config import LossConfig

_FLOAT_FIELDS = ("logprobs", "old_logprobs", "behav_logprobs", "advantages", "ref_logprobs")


@dataclass(frozen=True, slots=True)
class LossInput:
    """One packed batch of T tokens; every tensor has shape [T] and lives on one device.

    `logprobs` (current policy, carries grad), `old_logprobs` (proximal policy), `behav_logprobs` (engine),
    `advantages` (per token) and the optional `ref_logprobs` (reference policy, for the KL penalty) are floats;
    all but `logprobs` are treated as constants (detached). `loss_mask` is bool or 0/1 (1 = policy token, 0 =
    environment token) and is stored as bool. `seq_lens`: optional lengths of the packed sequences (sum T), needed
    only by the "seq_mean" aggregation. Values at environment tokens are never read, so they may be anything;
    policy tokens must be finite. Bad input raises ValueError naming the field."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    behav_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    seq_lens: tuple[int, ...] | None = None

    def __post_init__(self):
        floats = [name for name in _FLOAT_FIELDS if getattr(self, name) is not None]
        present = [*floats, "loss_mask"]
        for name in present:
            if not isinstance(getattr(self, name), torch.Tensor):
                raise ValueError(f"{name}: must be a torch.Tensor, got {type(getattr(self, name)).__name__}")
        if self.logprobs.dim() != 1 or self.logprobs.numel() == 0:
            raise ValueError(f"logprobs: must have shape [T] with T >= 1, got {tuple(self.logprobs.shape)}")
        for name in present:
            x = getattr(self, name)
            if x.shape != self.logprobs.shape:
                raise ValueError(f"{name}: shape {tuple(x.shape)} does not match logprobs {tuple(self.logprobs.shape)}")
            if x.device != self.logprobs.device:
                raise ValueError(f"{name}: on {x.device}, but logprobs is on {self.logprobs.device}")
            if name != "loss_mask" and not x.is_floating_point():
                raise ValueError(f"{name}: must be a floating-point tensor, got {x.dtype}")
        self._check_values(floats)
        object.__setattr__(self, "loss_mask", self.loss_mask.bool())
        if self.seq_lens is not None:
            self._check_seq_lens()

    def _check_values(self, floats):
        mask_T = self.loss_mask != 0
        with torch.no_grad():
            ok = [((self.loss_mask == 0) | (self.loss_mask == 1)).all()]
            ok += [(torch.isfinite(getattr(self, name)) | ~mask_T).all() for name in floats]
            ok = torch.stack(ok).tolist()  # one device sync for all the checks
        if not ok[0]:
            raise ValueError("loss_mask: values must be 0 or 1")
        for name, fine in zip(floats, ok[1:], strict=True):
            if not fine:
                raise ValueError(f"{name}: must be finite at every policy token (loss_mask == 1)")

    def _check_seq_lens(self):
        lens = self.seq_lens.tolist() if isinstance(self.seq_lens, torch.Tensor) else self.seq_lens
        if not isinstance(lens, list | tuple) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                         for n in lens):
            raise ValueError(f"seq_lens: must be a list of positive integers, got {self.seq_lens!r}")
        if sum(lens) != self.logprobs.numel():
            raise ValueError(f"seq_lens: sum {sum(lens)} does not match the number of tokens T={self.logprobs.numel()}")
        object.__setattr__(self, "seq_lens", tuple(lens))


LossFn = Callable[[LossInput, LossConfig], tuple[torch.Tensor, dict[str, float]]]

LOSSES: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator: add a loss to `LOSSES` under `name` (which must be new)."""

    def add(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss: {name!r} is already registered")
        LOSSES[name] = fn
        return fn

    return add


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise ValueError(f"loss: unknown loss {name!r}; known: {sorted(LOSSES)}")
    return LOSSES[name]


@register_loss("ppo_clip")
def ppo_clip(inp: LossInput, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO: per-token loss -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A), r = exp(logprobs - old_logprobs).
    Ignores the behaviour policy (its weights are still reported)."""
    t = _Tokens(inp)
    ratio_T = torch.exp(t.logprobs_T - t.old_T)
    pg_T, clipped_T = _clipped_surrogate(ratio_T, t.adv_T, cfg)
    return _finish(pg_T, clipped_T, ratio_T, t, inp, cfg, cap_frac=None)


@register_loss("decoupled_ppo")
def decoupled_ppo(inp: LossInput, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO (AReaL): per-token loss -w * min(u * A, clip(u, 1 - eps_low, 1 + eps_high) * A), with
    u = exp(logprobs - old_logprobs) the trust region around the proximal policy and w = exp(old_logprobs -
    behav_logprobs) the behaviour correction (a constant), clamped to `behav_cap` or zeroed above it."""
    t = _Tokens(inp)
    u_T = torch.exp(t.logprobs_T - t.old_T)
    pg_T, clipped_T = _clipped_surrogate(u_T, t.adv_T, cfg)
    over_cap_T = t.behav_weight_T > cfg.behav_cap
    if cfg.behav_mode == "truncate":
        weight_T = t.behav_weight_T.clamp(max=cfg.behav_cap)
    else:
        weight_T = torch.where(over_cap_T, 0.0, t.behav_weight_T)
    return _finish(weight_T * pg_T, clipped_T, u_T, t, inp, cfg, cap_frac=over_cap_T)


@register_loss("tis")
def tis(inp: LossInput, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling for the engine/trainer mismatch: the `ppo_clip` per-token loss times the
    constant min(exp(old_logprobs - behav_logprobs), tis_cap)."""
    t = _Tokens(inp)
    ratio_T = torch.exp(t.logprobs_T - t.old_T)
    pg_T, clipped_T = _clipped_surrogate(ratio_T, t.adv_T, cfg)
    weight_T = t.behav_weight_T.clamp(max=cfg.tis_cap)
    return _finish(weight_T * pg_T, clipped_T, ratio_T, t, inp, cfg, cap_frac=t.behav_weight_T > cfg.tis_cap)


class _Tokens:
    """The inputs in float32 with environment tokens zeroed, so that no value there (NaN, inf) can reach the loss
    or, through 0 * inf in the backward pass, the gradient. Only `logprobs_T` keeps its graph."""

    def __init__(self, inp: LossInput):
        self.mask_T = inp.loss_mask

        def clean(x, keep_grad=False):
            x = x.float() if keep_grad else x.detach().float()
            return torch.where(self.mask_T, x, 0.0)

        self.logprobs_T = clean(inp.logprobs, keep_grad=True)
        self.old_T = clean(inp.old_logprobs)
        self.behav_T = clean(inp.behav_logprobs)
        self.adv_T = clean(inp.advantages)
        self.ref_T = None if inp.ref_logprobs is None else clean(inp.ref_logprobs)
        self.behav_weight_T = torch.exp(self.old_T - self.behav_T)


def _clipped_surrogate(ratio_T, adv_T, cfg: LossConfig):
    """-min(r * A, clip(r) * A) per token, and where the clipped term won (zero gradient)."""
    unclipped_T = ratio_T * adv_T
    clipped_T = ratio_T.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv_T
    return -torch.minimum(unclipped_T, clipped_T), clipped_T.detach() < unclipped_T.detach()


def _aggregate(loss_T, mask_T, seq_lens, aggregation):
    # _Tokens already makes today's losses 0 at environment tokens; this keeps a future loss term that is nonzero
    # at zero inputs (an entropy bonus, say) from leaking them in.
    loss_T = torch.where(mask_T, loss_T, 0.0)
    mask_f_T = mask_T.float()
    if aggregation == "token_mean":
        return loss_T.sum() / mask_f_T.sum().clamp(min=1)
    seq_id_T = torch.repeat_interleave(torch.arange(len(seq_lens), device=mask_T.device),
                                       torch.tensor(seq_lens, device=mask_T.device))
    sums_S = loss_T.new_zeros(len(seq_lens)).index_add(0, seq_id_T, loss_T)
    counts_S = mask_f_T.new_zeros(len(seq_lens)).index_add(0, seq_id_T, mask_f_T)
    return (sums_S / counts_S.clamp(min=1)).sum() / (counts_S > 0).sum().clamp(min=1)


def _finish(pg_T, clipped_T, ratio_T, t: _Tokens, inp: LossInput, cfg: LossConfig, cap_frac):
    """Add the KL penalty, aggregate, and compute the metrics (one device sync for all of them)."""
    if cfg.kl_coef > 0 and t.ref_T is None:
        raise ValueError(f"ref_logprobs: required when kl_coef > 0 (kl_coef={cfg.kl_coef})")
    if cfg.aggregation == "seq_mean" and inp.seq_lens is None:
        raise ValueError("seq_lens: required by aggregation='seq_mean'")
    loss_T = pg_T
    kl_T = None
    if t.ref_T is not None:
        # k3 estimator of KL(pi_theta || pi_ref): unbiased, always >= 0, low variance.
        log_ref_ratio_T = t.ref_T - t.logprobs_T
        kl_T = torch.exp(log_ref_ratio_T) - log_ref_ratio_T - 1
        if cfg.kl_coef > 0:
            loss_T = pg_T + cfg.kl_coef * kl_T
    loss = _aggregate(loss_T, t.mask_T, inp.seq_lens, cfg.aggregation)

    with torch.no_grad():
        mask_T = t.mask_T
        count = mask_T.sum()
        mean = lambda x_T: torch.where(mask_T, x_T.float(), 0.0).sum() / count.clamp(min=1)
        w_T = t.behav_weight_T
        metrics = {
            "loss": loss.detach(),
            "pg_loss": _aggregate(pg_T.detach(), mask_T, inp.seq_lens, cfg.aggregation),
            "clip_frac": mean(clipped_T),
            "ratio_mean": mean(ratio_T),
            "ratio_min": torch.where(mask_T, ratio_T, math.inf).min(),
            "ratio_max": torch.where(mask_T, ratio_T, -math.inf).max(),
            "behav_weight_mean": mean(w_T),
            "behav_weight_min": torch.where(mask_T, w_T, math.inf).min(),
            "behav_weight_max": torch.where(mask_T, w_T, -math.inf).max(),
            "ess": mean(w_T) ** 2 / mean(w_T**2),
            "mismatch_kl": mean(t.behav_T - t.old_T),
            "mismatch_k3": mean(torch.expm1(t.old_T - t.behav_T) - (t.old_T - t.behav_T)),  # (expm1: exact near 0)
            "mismatch_ratio_beyond_2": mean((t.old_T - t.behav_T).abs() > math.log(2)),
            "num_policy_tokens": count,
        }
        if kl_T is not None:
            metrics["kl"] = mean(kl_T)
        if cap_frac is not None:
            metrics["cap_frac"] = mean(cap_frac)
        values = torch.stack([v.detach().float() for v in metrics.values()])
        values = torch.where(count > 0, values, 0.0).tolist()
    return loss, dict(zip(metrics, values, strict=True))
