"""Rollout routing replay (R3, arXiv 2510.11370), and how far the trainer's routing is from the rollout's.

The engine records, for every token it computes, the experts each mixture-of-experts layer routed it to
(`Episode.routed_experts`). Under replay the trainer's forward sends each token to those experts
(`Qwen3SparseMoeBlock.replay`, `tandem.model.moe.route`): the discrete choice, which the trainer's and the
engine's numerics would otherwise make apart (near-ties, other kernels, other batch shapes), is the rollout's, while
the weights of the chosen experts stay the trainer's router's softmax, so the routers still learn. Tokens without a
recorded row (-1: the engine never computed them) route live.

Whenever the episodes carry routing, replayed or not, the step reports the routing the trainer's routers would pick
themselves (the top k of the forward's router logits) against the recorded one: `routing_disagreement`, the fraction
of recorded token-layers whose expert sets differ, and `routing_disagreement_tokens`, the fraction of recorded tokens
with a difference in any layer. Under replay that is the disagreement replay hides (the experts used are the
recorded ones); what it removes shows in the losses' logprob mismatch (`mismatch_k3`, `mismatch_ratio_beyond_2`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tandem.config import ModelConfig
from tandem.model.moe import Qwen3SparseMoeBlock
from tandem.types import Episode

# the per-micro-batch counts the metrics are made of (summed over micro-batches and ranks, then divided)
COUNTS = ("routing_token_layers", "routing_token_layers_differ", "routing_tokens", "routing_tokens_differ")


def packed_routing(episodes: list[Episode], config: ModelConfig, device) -> torch.Tensor:
    """The episodes' recorded routing back to back, as the trainer packs their tokens: int16 [sum(len(tokens)),
    num_hidden_layers, num_experts_per_tok] on `device`, rows of -1 for an episode without routing. ValueError naming
    the episode for routing of another shape or with an expert id beyond the model's."""
    shape = (config.num_hidden_layers, config.num_experts_per_tok)
    parts = []
    for e in episodes:
        rows = e.routed_experts
        if rows is None:
            rows = torch.full((len(e.tokens), *shape), -1, dtype=torch.int16)
        elif tuple(rows.shape) != (len(e.tokens), *shape):
            raise ValueError(f"episode {e.episode_id}: routed_experts has shape {tuple(rows.shape)}, expected "
                             f"{(len(e.tokens), *shape)} (a row per token, of the model's layers and top-k)")
        elif rows.numel() and int(rows.max()) >= config.num_experts:
            raise ValueError(f"episode {e.episode_id}: routed_experts names expert {int(rows.max())}, the model has "
                             f"{config.num_experts}")
        parts.append(rows.to(torch.int16))
    return torch.cat(parts).to(device, non_blocking=True)


@contextmanager
def replaying(blocks: list[Qwen3SparseMoeBlock], rows_TLK: torch.Tensor | None) -> Iterator[None]:
    """Within: each block routes the packed tokens of `rows_TLK` (`packed_routing`) as recorded, forwards and the
    backward's recomputation of checkpointed layers alike (None: live, as outside)."""
    blocks = blocks if rows_TLK is not None else []
    for block in blocks:
        block.replay = rows_TLK[:, block.layer]
    try:
        yield
    finally:
        for block in blocks:
            block.replay = None


def disagreement(router_logits: list[torch.Tensor], blocks: list[Qwen3SparseMoeBlock],
                 rows_TLK: torch.Tensor) -> dict[str, torch.Tensor]:
    """The `COUNTS` of one forward (scalar tensors): recorded token-layers and tokens (a token counts where any of
    its layers has a row), and of those the ones where the routers' own top k (`tandem.model.moe.route`'s pick from
    `router_logits`, [T, E] per block) is another set of experts than the recorded one."""
    recorded, differ = [], []
    for logits_TE, block in zip(router_logits, blocks, strict=True):
        live_TK = torch.topk(torch.softmax(logits_TE.detach(), dim=-1, dtype=torch.float32), block.top_k).indices
        rows_TK = rows_TLK[:, block.layer].long()
        recorded_T = (rows_TK >= 0).all(-1)
        recorded.append(recorded_T)
        differ.append(recorded_T & (live_TK.sort(-1).values != rows_TK.sort(-1).values).any(-1))
    recorded_LT, differ_LT = torch.stack(recorded), torch.stack(differ)
    return dict(zip(COUNTS, (recorded_LT.sum(), differ_LT.sum(), recorded_LT.any(0).sum(), differ_LT.any(0).sum()),
                    strict=True))


def routing_metrics(counts: dict[str, float]) -> dict[str, float]:
    """The step's metrics from its `COUNTS` summed over the batch (0 where nothing was recorded)."""
    return {"routing_disagreement": counts["routing_token_layers_differ"] / max(counts["routing_token_layers"], 1),
            "routing_disagreement_tokens": counts["routing_tokens_differ"] / max(counts["routing_tokens"], 1)}
