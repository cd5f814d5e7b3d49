"""Group-relative advantage estimators.

Input: `rewards_GN`, one scalar reward per sample, G groups (prompts) of N samples each. Output: advantages of the
same shape [G, N], float32 (or the input's float dtype). Each function depends only on its own group, so the order
of groups does not matter. The trainer broadcasts a sample's advantage to all of its policy tokens.

Both estimators need N >= 2: a group of one sample has no baseline to compare against (its GRPO advantage is
always 0, so it would train on nothing, silently).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _check_rewards(rewards_GN) -> torch.Tensor:
    rewards_GN = torch.as_tensor(rewards_GN)
    if rewards_GN.dim() != 2:
        raise ValueError(f"rewards_GN: must have shape [num_groups, n] (rank 2), got shape {tuple(rewards_GN.shape)}")
    if rewards_GN.shape[1] < 2:
        raise ValueError(f"rewards_GN: needs n >= 2 samples per group for a baseline, got n={rewards_GN.shape[1]}")
    if not rewards_GN.is_floating_point():
        rewards_GN = rewards_GN.float()
    if not torch.isfinite(rewards_GN).all():
        bad = (~torch.isfinite(rewards_GN)).nonzero()[0].tolist()
        raise ValueError(f"rewards_GN: must be finite, got {rewards_GN[bad[0], bad[1]].item()} at [group, sample] "
                         f"= {bad}")
    return rewards_GN


def grpo_advantages(rewards_GN, *, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: `(r - mean_group) / (std_group + eps)`, with the unbiased (N - 1) std as in DeepSeekMath.

    `scale_by_std=False` is Dr.GRPO: `r - mean_group` only, which does not up-weight groups whose rewards
    barely differ. A group whose rewards are all equal gets advantage 0 either way."""
    if not eps >= 0:
        raise ValueError(f"eps: must be >= 0, got {eps!r}")
    rewards_GN = _check_rewards(rewards_GN)
    centered_GN = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centered_GN
    scale_G1 = rewards_GN.std(dim=1, keepdim=True) + eps
    # An all-equal group has nothing to learn from; keep it at 0 rather than 0 / 0 when eps is 0.
    return torch.where(scale_G1 > 0, centered_GN / scale_G1, 0.0)


def rloo_advantages(rewards_GN) -> torch.Tensor:
    """RLOO: `r_i - mean_{j != i} r_j`, the leave-one-out baseline (unbiased, since it excludes r_i itself).
    Equals `N / (N - 1) * (r_i - mean_group)`."""
    rewards_GN = _check_rewards(rewards_GN)
    n = rewards_GN.shape[1]
    others_mean_GN = (rewards_GN.sum(dim=1, keepdim=True) - rewards_GN) / (n - 1)
    return rewards_GN - others_mean_GN


AdvantageFn = Callable[..., torch.Tensor]

# name -> estimator; each takes `rewards_GN` [G, N] and returns advantages [G, N].
ADVANTAGES: dict[str, AdvantageFn] = {"grpo": grpo_advantages, "rloo": rloo_advantages}
