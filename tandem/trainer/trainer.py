"""The trainer: one optimizer step per batch of groups.

It recomputes every token's log-probability under the current parameters (the proximal policy of
decoupled PPO: with one optimizer step per batch, `old_logprobs` is exactly that recomputation, detached),
turns rewards into per-token advantages with the configured estimator, and minimises the configured loss
over micro-batches packed up to a token budget, accumulating gradients so the result equals one pass over
the whole batch (each micro-batch's token-mean loss is weighted by its share of the batch's policy tokens).

Token i of an episode is scored by the logits at position i - 1, at the rollout temperature, so that for
tokens sampled with the same weights the trainer's logprobs equal the engine's behaviour logprobs.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict

import torch

from tandem.config import LossConfig, TrainerConfig
from tandem.model.attention import PackedCausal
from tandem.model.qwen3 import Qwen3ForCausalLM
from tandem.trainer.advantages import ADVANTAGES
from tandem.trainer.losses import LossInput, get_loss
from tandem.types import Episode, Group


class Trainer:
    def __init__(self, model: Qwen3ForCausalLM, cfg: TrainerConfig, loss_cfg: LossConfig, temperature: float = 1.0):
        self.model, self.cfg, self.loss_cfg, self.temperature = model.train(), cfg, loss_cfg, temperature
        self.loss_fn = get_loss(cfg.loss)
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if loss_cfg.kl_coef > 0 else None
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.version = 0  # optimizer steps taken = the weight version of the current parameters
        self.device = next(model.parameters()).device

    def step(self, groups: list[Group]) -> dict[str, float]:
        """Train on `groups` (at least one); returns the step's metrics. Bumps `version`."""
        if not groups:
            raise ValueError("trainer: a batch needs at least one group")
        rewards_GN = torch.tensor([[e.reward for e in g.episodes] for g in groups], dtype=torch.float32)
        adv_GN = ADVANTAGES[self.cfg.advantage](rewards_GN)
        episodes = [e for g in groups for e in g.episodes]
        advantages = adv_GN.flatten().tolist()
        total = sum(sum(e.loss_mask[1:]) for e in episodes)
        sums: dict[str, float] = defaultdict(float)
        extremes: dict[str, float] = {}
        staleness: list[int] = []
        for idx in self._micro_batches(episodes):
            n, metrics = self._backward([episodes[i] for i in idx], [advantages[i] for i in idx], total)
            for key, value in metrics.items():
                if key.endswith("_max"):
                    extremes[key] = max(extremes.get(key, -math.inf), value)
                elif key.endswith("_min"):
                    extremes[key] = min(extremes.get(key, math.inf), value)
                else:
                    sums[key] += value * n
            staleness += [self.version - v for i in idx for v, m in zip(episodes[i].versions, episodes[i].loss_mask,
                                                                         strict=True) if m]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        out = {k: v / max(total, 1) for k, v in sums.items() if k != "num_policy_tokens"}
        out.update(extremes)
        out.update(
            reward_mean=rewards_GN.mean().item(), reward_std=rewards_GN.std(unbiased=False).item(),
            adv_mean=adv_GN.mean().item(), adv_std=adv_GN.std(unbiased=False).item(),
            adv_max=adv_GN.max().item(), adv_min=adv_GN.min().item(), grad_norm=grad_norm.item(),
            tokens_trained=float(total), tokens_total=float(sum(len(e.tokens) for e in episodes)),
            num_episodes=float(len(episodes)),
            staleness_min=float(min(staleness, default=0)), staleness_max=float(max(staleness, default=0)),
            staleness_mean=sum(staleness) / max(len(staleness), 1),
        )
        return out

    def _micro_batches(self, episodes: list[Episode]) -> list[list[int]]:
        """Pack episodes in order into micro-batches of at most `micro_batch_tokens` (a longer episode goes
        alone)."""
        batches, current, size = [], [], 0
        for i, e in enumerate(episodes):
            if current and size + len(e.tokens) > self.cfg.micro_batch_tokens:
                batches.append(current)
                current, size = [], 0
            current.append(i)
            size += len(e.tokens)
        return batches + [current] if current else batches

    def _token_logprobs(self, model, episodes: list[Episode]) -> torch.Tensor:
        """Log-probability of every token but each episode's first, flat [sum(len - 1)]."""
        lens = [len(e.tokens) for e in episodes]
        ids = torch.tensor([t for e in episodes for t in e.tokens], device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        hidden = model(ids, positions, PackedCausal(lens))
        starts = torch.tensor([0] + lens[:-1], device=self.device).cumsum(0)
        # rows that predict a next token within the same episode
        rows = torch.cat([torch.arange(s, s + n - 1, device=self.device) for s, n in zip(starts.tolist(), lens,
                                                                                            strict=True)])
        logits = model.compute_logits(hidden[rows]) / self.temperature
        return torch.log_softmax(logits, dim=-1).gather(1, ids[rows + 1][:, None])[:, 0]

    def _backward(self, episodes: list[Episode], advantages: list[float], total: int) -> tuple[int, dict]:
        def flat(values):
            return torch.tensor([v for e in values for v in e], dtype=torch.float32, device=self.device)

        logprobs = self._token_logprobs(self.model, episodes)
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref = self._token_logprobs(self.ref_model, episodes)
        mask = flat([e.loss_mask[1:] for e in episodes])
        inp = LossInput(
            logprobs=logprobs, old_logprobs=logprobs.detach(), behav_logprobs=flat([e.behav_logprobs[1:]
                                                                                   for e in episodes]),
            advantages=flat([[a] * (len(e.tokens) - 1) for e, a in zip(episodes, advantages, strict=True)]),
            loss_mask=mask, ref_logprobs=ref)
        loss, metrics = self.loss_fn(inp, self.loss_cfg)
        n = int(mask.sum().item())
        if n:
            (loss * (n / total)).backward()
        return n, metrics

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]
