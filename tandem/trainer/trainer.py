"""The trainer: one optimizer step per batch of groups.

It recomputes every token's log-probability under the current parameters (the proximal policy of
decoupled PPO: with one optimizer step per batch, `old_logprobs` is exactly that recomputation, detached),
turns rewards into per-token advantages with the configured estimator, and minimises the configured loss
over micro-batches packed up to a token budget, accumulating gradients so the result equals one pass over
the whole batch (each micro-batch's token-mean loss is weighted by its share of the batch's policy tokens).
Under FSDP (`TrainerConfig.fsdp`) each rank takes a share of the episodes and the same weighting holds over
all ranks' micro-batches, so the step equals the single-process one (see `tandem.trainer.parallel`).

Mixed precision (`param_dtype = "bfloat16"`): forward and backward run on bf16 weights while the optimizer
steps float32 master weights (gradients accumulate in float32, clipping and AdamW's state are float32); the
bf16 weights are refreshed from the masters after each step.

Token i of an episode is scored by the logits at position i - 1, at the rollout temperature, so that for
tokens sampled with the same weights the trainer's logprobs equal the engine's behaviour logprobs.

A mixture-of-experts model trains its routers and experts like any other weight (the routing weights carry the
gradient into the routers); its routers' load-balancing loss (`tandem.trainer.balance`) is computed at every step,
reported as `load_balancing_loss`, and added to the loss with weight `TrainerConfig.load_balancing_coef`. When the
episodes carry the rollout's routing, the step reports how often the routers disagree with it, and under
`TrainerConfig.routing_replay` every forward routes as the rollout did (`tandem.trainer.replay`).
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tandem.config import LossConfig, TrainerConfig
from tandem.model.attention import PackedCausal
from tandem.model.moe import Qwen3SparseMoeBlock
from tandem.model.qwen3 import Qwen3ForCausalLM, attention_output_and_mlp
from tandem.trainer import parallel, replay
from tandem.trainer.advantages import ADVANTAGES
from tandem.trainer.balance import load_balancing_loss
from tandem.trainer.losses import LossInput, get_loss
from tandem.types import Episode, Group

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BALANCE = "load_balancing_loss"  # the step's metric (MoE models only)
RAW_SUMS = {BALANCE, *replay.COUNTS}  # metrics summed over micro-batches as they are, not weighted by policy tokens
# What a rank with fewer micro-batches than another runs instead (no policy token: no gradient, no metric).
_PAD = Episode("pad", -1, tokens=[0, 0], loss_mask=[0, 0], behav_logprobs=[0.0, 0.0], versions=[-1, -1])


def compile_layers(model: Qwen3ForCausalLM, backend: str = "inductor") -> Qwen3ForCausalLM:
    """`model.compile_layers(backend)`, except that a mixture-of-experts layer's region after attention stays eager:
    its experts' reference path reads on the host which experts the tokens hit, a graph break and a recompilation
    for every new set of them. Its region before attention is compiled like every layer's."""
    model.compile_layers(backend)
    for layer in model.model.layers:
        if isinstance(layer.mlp, Qwen3SparseMoeBlock):
            layer.regions = (layer.regions[0], attention_output_and_mlp)
    return model


class Trainer:
    """`model`: the policy, converted to float32 in place; it becomes the master weights. `self.model` is what runs
    forward (a bf16 copy under mixed precision, the FSDP-sharded model under FSDP); read weights for the engine
    through `named_weights`. Under FSDP every rank builds its Trainer from the same weights and calls every method
    with the same arguments (each one is collective)."""

    def __init__(self, model: Qwen3ForCausalLM, cfg: TrainerConfig, loss_cfg: LossConfig, temperature: float = 1.0):
        self.cfg, self.loss_cfg, self.temperature = cfg, loss_cfg, temperature
        if cfg.routing_replay and not model.moe_blocks:
            raise ValueError("trainer.routing_replay: needs a mixture-of-experts model (this one has no expert layers)")
        self.loss_fn = get_loss(cfg.loss)
        self.param_dtype = DTYPES[cfg.param_dtype]
        if cfg.fsdp and not dist.is_initialized():
            raise ValueError("trainer.fsdp: needs torch.distributed initialised (init_process_group) first")
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if cfg.fsdp else (0, 1)
        self.master = model.float().train()
        self.ref_model = None
        if loss_cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.master).to(self.param_dtype).eval().requires_grad_(False)
        self.model = self.master
        if self.param_dtype != torch.float32 and not cfg.fsdp:
            self.model = copy.deepcopy(self.master).to(self.param_dtype)
            self._accumulate_grads_in_masters()
        if not cfg.fsdp and next(model.parameters()).is_cuda:
            for m in (m for m in (self.model, self.ref_model) if m is not None):
                if cfg.compile:  # eager layers leave the step host-bound (BENCHMARKS.md, trainer step)
                    compile_layers(m)
                elif cfg.fused_kernels:
                    m.use_training_kernels()
        if cfg.activation_checkpointing:
            parallel.checkpoint_layers(self.model)
        if cfg.fsdp:  # the sharded float32 parameters are the masters; FSDP casts its gathered copies
            self.model = self.master = parallel.shard_model(self.master, self.param_dtype)
        self.device = next(self.master.parameters()).device
        for block in self.model.moe_blocks:  # (the reference model's, if any, are not kept)
            block.keep_router_logits = True
        # on CUDA one fused optimizer kernel per step instead of foreach's many (BENCHMARKS.md, trainer step)
        self.optimizer = torch.optim.AdamW(self.master.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           fused=self.device.type == "cuda" or None)
        self.version = 0  # optimizer steps taken = the weight version of the current parameters
        # called (in the caller's thread) right before the tensors `named_weights` yields are written: an engine
        # may still be reading them by reference (`tandem.run.pending.PendingSync.fence`); what it raises fails
        # the write's call (a step or `load_state_dict`) before anything changed
        self.before_weight_write: Callable[[], None] | None = None

    def _accumulate_grads_in_masters(self) -> None:
        """After each backward, add every bf16 gradient into its master's float32 one and free it, so micro-batches
        accumulate in float32."""
        def hook(master):
            def add(p):
                if master.grad is None:
                    master.grad = p.grad.float()
                else:
                    master.grad.add_(p.grad)
                p.grad = None
            return add

        for (name, p), (master_name, master) in zip(self.model.named_parameters(), self.master.named_parameters(),
                                                    strict=True):
            assert name == master_name, (name, master_name)
            p.register_post_accumulate_grad_hook(hook(master))

    def step(self, groups: list[Group]) -> dict:
        """Train on `groups` (at least one); returns the step's metrics (over the whole batch, on every rank). Bumps
        `version`."""
        if not groups:
            raise ValueError("trainer: a batch needs at least one group")
        rewards_GN = torch.tensor([[e.reward for e in g.episodes] for g in groups], dtype=torch.float32)
        adv_GN = ADVANTAGES[self.cfg.advantage](rewards_GN)
        episodes = [e for g in groups for e in g.episodes]
        total = sum(sum(e.loss_mask[1:]) for e in episodes)
        sums, extremes = self._accumulate_gradients(episodes, adv_GN.flatten().tolist(), total)
        balance = sums.pop(BALANCE, None)  # already the batch's: a sum of shares
        routing = {key: sums.pop(key) for key in replay.COUNTS if key in sums}
        params = list(self.master.parameters())
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, self.cfg.grad_clip, grad_norm)
        if self.model is self.master:  # the optimizer writes the weights the engine reads
            self._before_weight_write()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._refresh_compute_weights()
        staleness = [self.version - v for e in episodes for v, m in zip(e.versions, e.loss_mask, strict=True) if m]
        self.version += 1
        out = {k: v / max(total, 1) for k, v in sums.items()}
        out.update((k, v if math.isfinite(v) else 0.0) for k, v in extremes.items())
        if balance is not None:
            out[BALANCE] = balance
        if routing:
            out.update(replay.routing_metrics(routing))
        out.update(
            reward_mean=rewards_GN.mean().item(), reward_std=rewards_GN.std(unbiased=False).item(),
            adv_mean=adv_GN.mean().item(), adv_std=adv_GN.std(unbiased=False).item(),
            adv_max=adv_GN.max().item(), adv_min=adv_GN.min().item(), grad_norm=grad_norm.item(),
            tokens_trained=float(total), tokens_total=float(sum(len(e.tokens) for e in episodes)),
            num_episodes=float(len(episodes)),
            staleness_min=float(min(staleness, default=0)), staleness_max=float(max(staleness, default=0)),
            staleness_mean=sum(staleness) / max(len(staleness), 1),
            staleness_tokens=[staleness.count(k) for k in range(max(staleness, default=-1) + 1)],  # at 0, 1, ...
        )
        return out

    def _accumulate_gradients(self, episodes: list[Episode], advantages: list[float],
                              total: int) -> tuple[dict[str, float], dict[str, float]]:
        """Forward and backward over this rank's share of the batch (`total` policy tokens in all), micro-batch by
        micro-batch; returns the loss metrics over the whole batch: sums weighted by policy tokens (but `RAW_SUMS`:
        the sum of the micro-batches' shares of the batch's load-balancing loss, and the routing's counts), and
        extremes (-inf / inf where no token counted)."""
        all_tokens = sum(len(e.tokens) for e in episodes)  # of the batch, whatever this rank's share
        # whether the batch carries routing decides every micro-batch's metrics (the same keys on every rank)
        routed = bool(self.model.moe_blocks) and any(e.routed_experts is not None for e in episodes)
        if self.cfg.fsdp:
            share = parallel.split_episodes([len(e.tokens) for e in episodes], self.world)[self.rank]
            episodes, advantages = [episodes[i] for i in share], [advantages[i] for i in share]
        micro = self._micro_batches(episodes)
        if self.cfg.fsdp:
            local = sum(sum(e.loss_mask[1:]) for e in episodes)
            total, num_micro = parallel.sync_batch(local, len(micro), total, self.device)
            micro += [[]] * (num_micro - len(micro))
        sums: dict[str, float] = defaultdict(float)
        extremes: dict[str, float] = {}
        for idx in micro:
            n, metrics = self._backward([episodes[i] for i in idx] or [_PAD], [advantages[i] for i in idx] or [0.0],
                                        total, all_tokens, routed)
            for key, value in metrics.items():
                # a micro-batch without policy tokens reports zeros, which are no extremes
                if key in RAW_SUMS:
                    sums[key] += value
                elif key.endswith("_max"):
                    extremes[key] = max(extremes.get(key, -math.inf), value if n else -math.inf)
                elif key.endswith("_min"):
                    extremes[key] = min(extremes.get(key, math.inf), value if n else math.inf)
                elif key != "num_policy_tokens":
                    sums[key] += value * n
        if self.cfg.fsdp:
            parallel.reduce_metrics(sums, extremes, self.device)
        return sums, extremes

    def _before_weight_write(self) -> None:
        if self.before_weight_write is not None:
            self.before_weight_write()

    @torch.no_grad()
    def _refresh_compute_weights(self) -> None:
        if self.model is not self.master:
            self._before_weight_write()
            torch._foreach_copy_(list(self.model.parameters()), list(self.master.parameters()))

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

    def _token_logprobs(self, model, episodes: list[Episode], select: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the tokens `select` (bool, flat [sum(len - 1)]) picks among every token but each
        episode's first: logits only for the rows that need them (the policy's tokens, a fraction of the rows)."""
        lens = [len(e.tokens) for e in episodes]
        ids = torch.tensor([t for e in episodes for t in e.tokens], device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        hidden = model(ids, positions, PackedCausal(lens))
        starts = torch.tensor([0] + lens[:-1], device=self.device).cumsum(0)
        # rows that predict a next token within the same episode
        rows = torch.cat([torch.arange(s, s + n - 1, device=self.device) for s, n in zip(starts.tolist(), lens,
                                                                                            strict=True)])[select]
        logits = model.compute_logits(hidden[rows]) / self.temperature
        return torch.log_softmax(logits, dim=-1).gather(1, ids[rows + 1][:, None])[:, 0]

    def _backward(self, episodes: list[Episode], advantages: list[float], total: int,
                  all_tokens: int | None = None, routed: bool = False) -> tuple[int, dict]:
        """Forward and backward over one micro-batch, its loss weighted by its share of the batch: of the batch's
        `total` policy tokens (the policy loss) and of its `all_tokens` tokens (the load-balancing loss, whose
        share is the metric `BALANCE`; None: the micro-batch is the batch). `routed`: the batch carries the
        rollout's routing (replayed under `routing_replay`, and its disagreement counted). Returns the micro-batch's
        policy tokens and its loss metrics."""
        def flat(values):
            return torch.tensor([v for e in values for v in e], dtype=torch.float32, device=self.device)

        mask = flat([e.loss_mask[1:] for e in episodes])
        n = sum(sum(e.loss_mask[1:]) for e in episodes)  # policy tokens, counted on the host
        select = mask.bool()
        if not n:
            select[0] = True  # one row at least (masked out): the loss stays connected to every weight
        rows = replay.packed_routing(episodes, self.model.config, self.device) if routed else None
        replayed = rows if self.cfg.routing_replay else None
        # (held through the backward: it recomputes checkpointed layers, which must route the same way)
        with replay.replaying(self.model.moe_blocks, replayed):
            logprobs = self._token_logprobs(self.model, episodes, select)
            router_logits = self._take_router_logits()
            balance = self._balance(router_logits, episodes, all_tokens or sum(len(e.tokens) for e in episodes))
            counts = {} if rows is None else replay.disagreement(router_logits, self.model.moe_blocks, rows)
            ref = None
            if self.ref_model is not None:
                with torch.no_grad(), replay.replaying(self.ref_model.moe_blocks, replayed):
                    ref = self._token_logprobs(self.ref_model, episodes, select)
            inp = LossInput(
                logprobs=logprobs, old_logprobs=logprobs.detach(),
                behav_logprobs=flat([e.behav_logprobs[1:] for e in episodes])[select],
                advantages=flat([[a] * (len(e.tokens) - 1) for e, a in zip(episodes, advantages, strict=True)])[select],
                loss_mask=mask[select], ref_logprobs=ref)
            loss, metrics = self.loss_fn(inp, self.loss_cfg)
            loss = loss * (n / max(total, 1))
            coef = self.cfg.load_balancing_coef
            if balance is not None:
                metrics[BALANCE] = balance.item()
                if coef > 0:
                    loss = loss + coef * balance
            if counts:
                metrics.update(zip(counts, torch.stack(list(counts.values())).tolist(), strict=True))
            # under FSDP every rank runs every backward: its gradient reduction is collective
            if n or self.cfg.fsdp or (balance is not None and coef > 0):
                loss.backward()
        return n, metrics

    def _take_router_logits(self) -> list[torch.Tensor]:
        """The router logits [T, E] the MoE blocks kept in the forward just run, one per block (dropped from them)."""
        logits = [block.router_logits for block in self.model.moe_blocks]
        for block in self.model.moe_blocks:
            block.router_logits = None
        return logits

    def _balance(self, router_logits: list[torch.Tensor], episodes: list[Episode],
                 all_tokens: int) -> torch.Tensor | None:
        """The micro-batch's share of the batch's load-balancing loss over the forward's `router_logits`: each
        episode's loss weighted by its share of the batch's `all_tokens` tokens (a padding micro-batch's is 0). None
        for a dense model."""
        if not router_logits:
            return None
        lens = [len(e.tokens) for e in episodes]
        weights_S = torch.tensor([0.0 if e is _PAD else n / all_tokens for e, n in zip(episodes, lens, strict=True)],
                                 device=self.device)
        with torch.set_grad_enabled(self.cfg.load_balancing_coef > 0):  # (only reported: no graph to keep)
            per_episode_S = load_balancing_loss(router_logits, self.model.config.num_experts_per_tok, lens)
            return (per_episode_S * weights_S).sum()

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor in the compute dtype) per parameter, as `named_parameters` names them
        (a tied head only once), for the engine. Without FSDP the tensors are the live weights (detached, not
        copies): read them before the next `step`. Under FSDP they are all-gathered a bucket at a time
        (`parallel.gathered`): every rank iterates it in step and every rank gets every full tensor (a copy)."""
        yield from parallel.gathered(self.model.named_parameters(), self.param_dtype)

    def state_dict(self) -> dict:
        """The float32 master weights, the optimizer's state and the version; tensors may be the live ones (as in
        PyTorch's state dicts): save or copy them before the next `step`. Under FSDP: collective, full (unsharded)
        tensors on CPU on rank 0, empty model and optimizer states on the other ranks."""
        if self.cfg.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict  # (slow to import)

            model, optimizer = get_state_dict(self.master, self.optimizer,
                                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            model, optimizer = self.master.state_dict(), self.optimizer.state_dict()
        return {"model": model, "optimizer": optimizer, "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` saved; the trainer may keep `state`'s tensors (as PyTorch's optimizers do), so
        pass a state read from disk or a copy. Under FSDP: collective, rank 0's state is read and broadcast."""
        self._before_weight_write()
        if self.cfg.fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            # two calls: `set_state_dict` skips the model on ranks whose model state is empty, and deadlocks;
            # a copy of the model's dict: `set_model_state_dict` puts this rank's shards into the one it is given
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(self.master, dict(state["model"]), options=options)
            set_optimizer_state_dict(self.master, self.optimizer, state["optimizer"], options=options)
        else:
            self.master.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self._refresh_compute_weights()
        self.version = state["version"]
