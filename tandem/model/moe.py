"""Qwen3-MoE's sparse MLP: a router picks each token's top-k experts, and the token's output is the routing-weighted
sum of those experts' SwiGLU MLPs. Parameter names and maths equal Hugging Face's `Qwen3MoeSparseMoeBlock`
(transformers 5): the router `gate.weight` [E, H] (its logits in the model's dtype, the softmax in fp32), the
experts stacked as `experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `experts.down_proj` [E, H, I].
Checkpoints on disk store one tensor per expert; `tandem.model.loader` maps those onto the stacked ones.

Expert parallelism: over the ranks of `ep`, rank r holds experts [r * E/ep, (r+1) * E/ep). Every rank routes all
of the step's tokens (its input is the same on every rank), computes the tokens' contributions of the experts it
holds, and one all-reduce over `ep` sums them: the dispatch is local, the combine a collective. The ranks must
agree on the routing, or the sum mixes two routings silently; `routing_checksum` lets the engine's lockstep
sentinel compare it (see `tandem.engine.lockstep`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import ModelConfig
from tandem.distributed import collectives
from tandem.distributed.parallel import SINGLE, Layout, TPGroup


def route(logits_TE: torch.Tensor, k: int, normalize: bool,
          recorded_TK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k]): the top-k of the fp32 softmax, renormalised to
    sum to one if `normalize` (Hugging Face's `norm_topk_prob`). `recorded_TK` (rollout routing replay; int [T, k]):
    its rows that hold no -1 impose their experts, weighted by the softmax gathered at them (so the router still
    gets a gradient); the other rows route as without it, bit for bit."""
    probs = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if recorded_TK is not None:
        ids = torch.where((recorded_TK >= 0).all(-1, keepdim=True), recorded_TK.long(), ids)
        weights = probs.gather(-1, ids)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits_TE.dtype), ids


def silu_mul(gate, up):
    return F.silu(gate) * up


class Qwen3Experts(nn.Module):
    """This rank's share of a layer's experts, stacked. `kernel`: a fused `(x_TH, gate_up, down, local_ids_TK,
    weights_TK) -> y_TH` with the reference's contract (the GPU's grouped path; None: the reference)."""

    def __init__(self, config: ModelConfig, ep: TPGroup = SINGLE):
        super().__init__()
        E, H, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_local = ep.split(E, "num_experts")
        self.start, self.ep = ep.rank * self.num_local, ep
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, 2 * inter, H))
        self.down_proj = nn.Parameter(torch.empty(self.num_local, H, inter))
        self.shard_layouts = {"gate_up_proj": Layout(0, (E, 2 * inter, H), ep),
                              "down_proj": Layout(0, (E, H, inter), ep)}
        self.silu_mul = silu_mul
        self.kernel = None

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """Each token's sum of weight * expert(x) over its routed experts (all of them: this rank's summed with
        the other ranks' over `ep`)."""
        local_TK = ids_TK - self.start if self.start else ids_TK  # this rank's: 0..num_local-1; others' outside
        if self.kernel is not None:
            out = self.kernel(x_TH, self.gate_up_proj, self.down_proj, local_TK, weights_TK)
        else:
            out = self.reference(x_TH, local_TK, weights_TK)
        if self.ep.size > 1:
            collectives.all_reduce(out, group=self.ep.group)
        return out

    def reference(self, x_TH, local_TK, weights_TK):
        """One matrix multiply per expert hit, over the tokens routed to it (reads the hit experts on the host)."""
        out = torch.zeros_like(x_TH)
        mine = (local_TK >= 0) & (local_TK < self.num_local)
        for e in torch.unique(local_TK[mine]).tolist():
            token, slot = torch.where(local_TK == e)
            gate, up = F.linear(x_TH[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.silu_mul(gate, up), self.down_proj[e]) * weights_TK[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class Qwen3SparseMoeBlock(nn.Module):
    """`routing_checksum`: an int64 scalar the block adds a hash of its routing to (the model's, set under
    parallelism; None: not kept). `keep_router_logits`: keep the last forward's router logits in `router_logits`
    (for a trainer's load-balancing loss). `capture`: (store [S, layers, k], slots [T]) to write each token's expert
    ids to, row `slots[t]`, column `layer` (set per forward by the model; None: not kept)."""

    def __init__(self, config: ModelConfig, layer: int, ep: TPGroup = SINGLE):
        super().__init__()
        self.layer, self.top_k, self.normalize = layer, config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Qwen3Experts(config, ep)
        self.routing_checksum: torch.Tensor | None = None
        self.keep_router_logits, self.router_logits = False, None
        self.capture: tuple[torch.Tensor, torch.Tensor] | None = None
        self.replay: torch.Tensor | None = None
        self.route_kernel = None  # a fused `route` without a recorded routing (the GPU's; None: `route`)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        logits_TE = self.gate(x_TH)
        if self.route_kernel is not None and self.replay is None:
            weights_TK, ids_TK = self.route_kernel(logits_TE, self.top_k, self.normalize)
        else:
            weights_TK, ids_TK = route(logits_TE, self.top_k, self.normalize, self.replay)
        if self.keep_router_logits:
            self.router_logits = logits_TE
        if self.routing_checksum is not None:
            self.routing_checksum.add_(routing_hash(ids_TK, self.layer))
        if self.capture is not None:
            store, slots = self.capture
            store[:, self.layer].index_copy_(0, slots, ids_TK.to(store.dtype))
        return self.experts(x_TH, ids_TK, weights_TK)


def routing_hash(ids_TK: torch.Tensor, layer: int) -> torch.Tensor:
    """An int64 scalar that changes when any token's expert (or its slot) changes: sum of (id + 1) * (its flat
    position + 1) * (layer + 1). On the device, no host sync (it runs inside CUDA graphs)."""
    position = torch.arange(1, ids_TK.numel() + 1, device=ids_TK.device).view(ids_TK.shape)
    return ((ids_TK.long() + 1) * position).sum() * (layer + 1)
