"""The routers' load-balancing loss of a mixture-of-experts model: Switch Transformer's auxiliary loss (Fedus et al.,
eqs. 4-6), as Hugging Face's `load_balancing_loss_func` computes it over all MoE layers' router logits:

    loss = E * sum_e f_e * P_e

over the rows of every MoE layer together (L layers x T tokens), where f_e is the number of top-k picks of expert e
over the number of rows and P_e the mean router probability of expert e. f counts picks, so it has no gradient: the
loss pushes probability away from the experts picked most. Perfectly balanced routing gives k (the experts picked per
token); routing that always picks the same k experts gives E.

The trainer takes it per episode (each episode is Hugging Face's batch), then the mean over the batch's episodes
weighted by their tokens: f and P are means, so a loss over a micro-batch would depend on which episodes share it,
and the step would no longer be independent of `micro_batch_tokens` and of the split of a batch over FSDP ranks.
"""

from __future__ import annotations

import torch


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int, seq_lens: list[int]) -> torch.Tensor:
    """Each packed sequence's loss, [S] float32. `router_logits`: one [T, E] tensor per MoE layer (the same T tokens,
    `seq_lens` of them back to back, sum T). The picks are the model's (`tandem.model.moe.route`: the top k of the
    float32 softmax). The gradient flows into the logits through P."""
    E = router_logits[0].shape[-1]
    picks_TE = probs_TE = None
    for logits_TE in router_logits:
        p_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        hit_TE = torch.zeros_like(p_TE).scatter_(-1, torch.topk(p_TE.detach(), top_k, dim=-1).indices, 1.0)
        picks_TE = hit_TE if picks_TE is None else picks_TE + hit_TE
        probs_TE = p_TE if probs_TE is None else probs_TE + p_TE
    device = probs_TE.device
    lens_S = torch.tensor(seq_lens, device=device)
    seq_T = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens_S, output_size=sum(seq_lens))
    picks_SE = torch.zeros(len(seq_lens), E, device=device).index_add_(0, seq_T, picks_TE)
    probs_SE = torch.zeros(len(seq_lens), E, device=device).index_add_(0, seq_T, probs_TE)
    rows_S = (lens_S * len(router_logits)).float()
    return E * (picks_SE * probs_SE).sum(-1) / rows_S**2
