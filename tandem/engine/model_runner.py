"""Turns a step's chunks into tensors, runs the model over the paged KV cache and samples.

The seam for the GPU fast path: another runner may build a different `AttentionContext` (Triton paged
kernels), capture graphs and overlap, as long as `run` keeps its contract.
"""

from __future__ import annotations

import torch

from tandem.engine.kv_pool import KVPool
from tandem.engine.sampler import SamplingBatch, sample
from tandem.engine.scheduler import Chunk
from tandem.model.attention import PagedAttention
from tandem.model.qwen3 import Qwen3ForCausalLM


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, pool: KVPool):
        self.model, self.pool = model, pool
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> tuple[list[int], list[float]]:
        """Compute KV for every chunk; sample one token for each chunk that reaches its request's end.
        Returns (token ids, logprobs) for those chunks, in chunk order. Writes only the chunks' new slots
        of the KV pool."""
        ids, positions, new_slots, kv_slots, sample_rows = [], [], [], [], []
        row = 0
        for c in chunks:
            end = c.start + c.num_tokens
            ids.extend(c.req.tokens[c.start:end])
            positions.append(torch.arange(c.start, end))
            slots = self.pool.slots(c.req.pages, 0, end, device=self.device)
            new_slots.append(slots[c.start:])
            kv_slots.append(slots)
            row += c.num_tokens
            if c.sample:
                sample_rows.append(row - 1)
        ctx = PagedAttention(self.pool.k_cache, self.pool.v_cache, torch.cat(new_slots),
                             q_lens=[c.num_tokens for c in chunks], kv_lens=[c.start + c.num_tokens for c in chunks],
                             kv_slots=kv_slots)
        hidden = self.model(torch.tensor(ids, device=self.device), torch.cat(positions).to(self.device), ctx)
        if not sample_rows:
            return [], []
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        tokens, logprobs = sample(logits, self._sampling_batch([c.req for c in chunks if c.sample]))
        return tokens.tolist(), logprobs.tolist()

    def _sampling_batch(self, reqs) -> SamplingBatch:
        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        return SamplingBatch(
            temperatures=col([r.sampling.temperature for r in reqs], torch.float32),
            top_ps=col([r.sampling.top_p for r in reqs], torch.float32),
            top_ks=col([r.sampling.top_k for r in reqs], torch.int64),
            min_ps=col([r.sampling.min_p for r in reqs], torch.float32),
            seeds=col([r.seed for r in reqs], torch.int64),
            positions=col([r.num_generated for r in reqs], torch.int64),
        )
