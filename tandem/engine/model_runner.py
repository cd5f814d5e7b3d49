"""Turns a step's chunks into tensors, runs the model over the paged KV cache and samples.

Two paths behind one `run`:
  - decode steps (every chunk one token, the common case) go through fixed-shape buffers padded to a
    ladder of batch sizes; on CUDA each size is captured once as a CUDA graph and replayed, with the
    Triton paged-decode kernel (under tensor parallelism with NCCL's collectives inside the graphs: each replay
    is one flight-recorder record, see `collectives.replay`); elsewhere the same code runs eagerly with the
    PyTorch reference kernel;
  - steps with prefill chunks go, on CUDA, through the Triton paged-prefill kernel over block tables
    (`BlockTablePrefill`); up to `max_graph_tokens` tokens also through fixed-shape buffers padded to a ladder
    of token counts, each captured once as a CUDA graph (the kernel's grid a fixed tile list, see
    `fill_tiles`), since such steps are launch-bound when run eagerly; larger ones run eagerly. Elsewhere (or
    with `kernels=False`) they run eagerly with the reference `PagedAttention`.

Overlap: `launch` returns before the device finishes. A decode row whose input token was sampled by the step
still in flight (a placeholder on the host, `PENDING`) reads it from that step's device tensor, and the
sampled ids travel to pinned host memory behind an event, so the host can schedule and launch step n+1
while step n runs and read step n's tokens without waiting for step n+1.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.distributed import collectives, faults
from tandem.distributed.parallel import TPGroup, cdiv
from tandem.engine.kv_pool import KVPool
from tandem.engine.request import Request
from tandem.engine.sampler import SamplingBatch, sample, top_logprobs, with_requests
from tandem.engine.scheduler import PENDING, Chunk
from tandem.engine.step_inputs import DecodeInputs, block_table
from tandem.engine.streams import RaceGuard, StreamRuntime, engine_placements
from tandem.model.attention import BlockTableDecode, BlockTablePrefill, PagedAttention, paged_decode_reference
from tandem.model.qwen3 import Qwen3ForCausalLM

log = logging.getLogger(__name__)

# token counts of the mixed (prefill) steps' graphs: steps are padded up to the next one
MIXED_SIZES = [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]


class StepInputError(RuntimeError):
    """A step's inputs could not be built from its requests (`ModelRunner.check_inputs` names the request)."""


@dataclass
class Launched:
    """A step on its way: the sampled ids and logprobs of its sampling chunks, in chunk order, on the device
    (`tokens`, read by the next step's pending rows) and on their way to the host (`result`)."""

    chunks: list[Chunk]
    version: int = 0  # of the weights it runs with (the engine sets it): its sampled tokens' version
    tokens: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    host_tokens: torch.Tensor | None = None
    host_logprobs: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    routing: torch.Tensor | None = None  # the model's routing checksum after this step (see `routing_value`)
    host_routing: torch.Tensor | None = None
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # top logprobs and their ids [B, k], when a row asks

    def top_result(self) -> list[list[tuple[float, int]]] | None:
        """Per sampled row, `top` as (logprob, token id) pairs, most likely first (None: not asked). After `result`."""
        if self.top is None:
            return None
        return [list(zip(lps, ids, strict=True)) for lps, ids in zip(*(t.tolist() for t in self.top), strict=True)]
    order: StreamRuntime | None = None

    def result(self) -> tuple[list[int], list[float]]:
        if self.tokens is None:
            return [], []
        if self.order is not None:
            self.order.note("read_tokens")
        if self.ready is not None:
            self.ready.synchronize()
            return self.host_tokens.tolist(), self.host_logprobs.tolist()
        return self.tokens.tolist(), self.logprobs.tolist()

    def routing_value(self) -> int:
        """The routing checksum (`Qwen3ForCausalLM.keep_routing_checksum`) after this step; 0 if not kept. Call
        after `result`."""
        if self.routing is None:
            return 0
        return int(self.host_routing if self.ready is not None else self.routing)


def _kernels(device: torch.device, enabled: bool):
    """(decode kernel, prefill kernel or None): Triton's on CUDA, else the PyTorch references."""
    if device.type != "cuda" or not enabled:
        return paged_decode_reference, None
    try:
        from tandem.kernels.decode_attention import paged_decode_attention
        from tandem.kernels.prefill_attention import paged_prefill_attention
    except ImportError:  # no Triton: the references work on CUDA too, without graphs
        log.warning("Triton is not available: attention runs the PyTorch references, without CUDA graphs")
        return paged_decode_reference, None
    return paged_decode_attention, paged_prefill_attention


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, pool: KVPool, max_context_len: int, config: EngineConfig,
                 tp: TPGroup | None = None, order: StreamRuntime | None = None):
        """`tp`: the engine's ranks (default: the model's tensor-parallel group). `order`: where each piece of
        device work runs (`tandem.engine.streams`; default: the engine's placement, shared with the host tier by
        the engine core). Reads `config`'s race_guard (count changes to a replay's inputs while it runs),
        max_running_requests (the largest decode batch), cuda_graphs, token_broadcast, fused_kernels (on CUDA,
        attention through the Triton kernels; off: the PyTorch references) and
        prefill_graph_max_tokens (steps with prefill chunks of up to this many tokens in all run through fixed
        buffers, and graphs if cuda_graphs, when the prefill kernel is Triton's)."""
        self.model, self.pool = model, pool
        self.tp, self.token_broadcast = tp or model.tp, config.token_broadcast
        self.num_launches = 0
        self.device = next(model.parameters()).device
        self.order = order or StreamRuntime(engine_placements(), self.device)
        self.kernel, self.prefill_kernel = _kernels(self.device, config.fused_kernels)
        S = config.max_running_requests  # (a step's chunks: one per running request)
        self.batch_sizes = [b for b in [1, 2, 4, 8, *range(16, S + 1, 16)] if b <= S]
        # a step's tokens: its prefill budget and one per other request
        max_graph_tokens = min(config.prefill_graph_max_tokens, config.max_prefill_tokens + S)
        self.mixed_sizes = []  # (the buffers' sequence row S is an empty padding one)
        if self.prefill_kernel is not None and max_graph_tokens > 0:
            self.mixed_sizes = [t for t in MIXED_SIZES if t < max_graph_tokens] + [max_graph_tokens]
        T = max([self.batch_sizes[-1], *self.mixed_sizes])
        B, P = max(self.batch_sizes[-1], S + 1), cdiv(max_context_len, pool.page_size)  # (P: pages of a request)
        self.ids_B = torch.zeros(T, dtype=torch.long, device=self.device)  # (T: tokens of a decode or mixed step)
        self.positions_B = torch.zeros(T, dtype=torch.long, device=self.device)
        self.slots_B = torch.zeros(T, dtype=torch.long, device=self.device)
        self.block_table_BP = torch.zeros(B, P, dtype=torch.int32, device=self.device)
        self.seq_lens_B = torch.zeros(B, dtype=torch.int32, device=self.device)  # (mixed steps')
        self.decode_in = DecodeInputs(self.batch_sizes, self.device)  # (decode steps' ids, ..., seq_lens)
        if self.mixed_sizes:
            from tandem.kernels.prefill_attention import choose_blocks, fill_tiles, max_tiles
            self.fill_tiles = fill_tiles
            attn = model.model.layers[0].self_attn  # (this rank's heads under tensor parallelism)
            self.block_m = choose_blocks(attn.num_heads // attn.num_kv_heads, attn.head_dim, pool.k_cache.dtype)[0]
            self.num_tiles = {t: max_tiles(t, S, self.block_m) for t in self.mixed_sizes}
            self.pad_seq = S  # the buffers' empty padding sequence: rows 0..S-1 are the step's, row S never is
            self.q_starts_S1 = torch.zeros(S + 2, dtype=torch.int32, device=self.device)
            self.tiles_2N = torch.zeros(2, max(self.num_tiles.values()), dtype=torch.int32, device=self.device)
        # size -> (graph, its output, the collectives inside it: NCCL's under tensor parallelism)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, list[str]]] = {}
        self.mixed_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, list[str]]] = {}
        self.last_prepare_seconds = 0.0
        self.guard = None
        if config.race_guard:
            inputs = [self.ids_B, self.positions_B, self.slots_B, self.block_table_BP, self.seq_lens_B,
                      self.decode_in.buffer]
            self.guard = RaceGuard(inputs + ([self.q_starts_S1, self.tiles_2N] if self.mixed_sizes else []))
        triton = self.kernel is not paged_decode_reference
        capturable = self.tp.size == 1 or dist.get_backend(self.tp.group) == "nccl"
        if config.cuda_graphs and self.device.type == "cuda" and triton and capturable:
            self._capture()
        if self.prefill_kernel is not None:
            self._compile_eager_kernels()

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> tuple[list[int], list[float]]:
        """`launch` and wait for the result (no step in flight before it)."""
        return self.launch(chunks, None).result()

    @torch.inference_mode()
    def launch(self, chunks: list[Chunk], prev: Launched | None) -> Launched:
        """Compute KV for every chunk; sample one token for each chunk that reaches its request's end. Input
        tokens that are `PENDING` must be ones `prev` sampled (`req.pending_row` is their index there). Writes
        only the chunks' new slots of the KV pool (and, for padding rows of a decode batch, the pool's scratch
        page). Sets `last_prepare_seconds`: host time spent building inputs before the forward pass."""
        self._t0 = time.perf_counter()
        sampling_reqs = [c.req for c in chunks if c.sample]
        # (a one-token chunk that does not sample, a prompt cut short by the budget or the pool, goes the mixed
        # way, which samples the rows that ask: the decode way samples every row)
        if len(sampling_reqs) == len(chunks) <= self.batch_sizes[-1] and all(c.num_tokens == 1 for c in chunks):
            logits, sampling = self._decode(chunks, prev)
        elif self.mixed_sizes and sum(c.num_tokens for c in chunks) <= self.mixed_sizes[-1]:
            logits, sampling = self._mixed_static(chunks, prev, sampling_reqs)
        else:
            logits, sampling = self._mixed(chunks, prev, sampling_reqs)
        launched = Launched(chunks, order=self.order)
        if logits is None:
            return launched
        with self.order.work("sample"):
            launched.tokens, launched.logprobs = sample(logits, sampling)
            launched.top = top_logprobs(logits, sampling)
            if self.model.routing_checksum is not None:
                launched.routing = self.model.routing_checksum.clone()
        if self.tp.size > 1:
            with self.order.work("agree"):
                self._agree(launched)
        if self.device.type == "cuda":
            self._copy_out(launched)
        return launched

    def _copy_out(self, launched: Launched) -> None:
        """The sampled ids (and logprobs, routing checksum, top logprobs) on their way to pinned host memory, behind
        an event."""
        with self.order.work("copy_out"):
            launched.host_tokens = torch.empty(launched.tokens.shape, dtype=torch.long, pin_memory=True)
            launched.host_logprobs = torch.empty(launched.logprobs.shape, dtype=torch.float32, pin_memory=True)
            launched.host_tokens.copy_(launched.tokens, non_blocking=True)
            launched.host_logprobs.copy_(launched.logprobs, non_blocking=True)
            if launched.routing is not None:
                launched.host_routing = torch.empty((), dtype=torch.long, pin_memory=True)
                launched.host_routing.copy_(launched.routing, non_blocking=True)
            if launched.top is not None:  # (read after `result`: not behind the step launched next)
                launched.top = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                                     for t in launched.top)
            launched.ready = torch.cuda.Event()
            launched.ready.record()

    def _agree(self, launched: Launched) -> None:
        """Every rank continues with rank 0's samples: ranks can differ in the last bits of their logits (other
        reduction orders, other hardware), and a near tie or different RNG state would then pick another token,
        end another request, and set the ranks on different schedules. (Fault injection may flip a token here
        first, to prove the point.)"""
        self.num_launches += 1
        if faults.should_flip(self.num_launches, self.tp.rank) and launched.tokens.numel():
            launched.tokens[0] = (launched.tokens[0] + 1) % self.model.config.vocab_size
        if self.token_broadcast:  # one collective: ids (< 2**53) and fp32 logprobs are exact in float64
            both = torch.stack([launched.tokens.double(), launched.logprobs.double()])
            collectives.broadcast(both, src=0, group=self.tp.group)
            launched.tokens, launched.logprobs = both[0].long(), both[1].float()

    def _input_ids(self, ids: list[int], pending: list[tuple[int, int]], prev: Launched | None,
                   out: torch.Tensor | None = None):
        """`ids` on the device, with the rows listed in `pending` ((row, index in prev's samples)) taken from
        the step in flight. Writes into `out` if given."""
        host = self._pinned(torch.tensor(ids))
        out = host.to(self.device, non_blocking=True) if out is None else out.copy_(host, non_blocking=True)
        self._gather_pending(out, pending, prev)
        return out

    def _gather_pending(self, out: torch.Tensor, pending: list[tuple[int, int]], prev: Launched | None) -> None:
        """The rows of `out` listed in `pending` ((row, index in prev's samples)) taken from the step in flight."""
        if pending:
            rows, src = zip(*pending, strict=True)
            out[self._to_device(rows)] = prev.tokens[self._to_device(src)]

    def _sampling(self, reqs) -> SamplingBatch | None:
        """`_sampling_batch` of the step's sampling requests (None if none), its failures a `StepInputError`."""
        try:
            return self._sampling_batch(reqs) if reqs else None
        except (RuntimeError, OverflowError, TypeError, ValueError) as e:
            raise StepInputError(f"the step's sampling parameters: {e}") from e

    def _pinned(self, host: torch.Tensor) -> torch.Tensor:
        """A copy from pageable memory makes CUDA wait for the stream (the step in flight) first; from pinned
        memory it does not, which is what lets the host run ahead."""
        return host.pin_memory() if self.device.type == "cuda" else host

    def _to_device(self, values, dtype=None) -> torch.Tensor:
        """A host list (or tensor) on the device without waiting for the device."""
        host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        return self._pinned(host).to(self.device, non_blocking=True)

    @staticmethod
    def _pending(row: int, req, token: int, pending: list) -> int:
        if token == PENDING:
            pending.append((row, req.pending_row))
            return 0
        return token

    # ---- decode: fixed shapes, graphs on CUDA -------------------------------------------------------------
    def _decode(self, chunks: list[Chunk], prev: Launched | None) -> tuple[torch.Tensor, SamplingBatch]:
        """Every chunk one token that samples: the inputs in one pinned buffer, one copy (`DecodeInputs`)."""
        n = len(chunks)
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        # only the columns in use: entries past a row's length are never read (its seq_len bounds the kernel)
        width = max(cdiv(c.start + 1, self.pool.page_size) for c in chunks)
        with self.order.work("step_inputs"):
            try:
                pending, sampling = self.decode_in.send(chunks, bs, self.pool, self.block_table_BP[:bs, :width],
                                                            self.model.config.vocab_size)
                sampling = with_requests(sampling, [c.req for c in chunks], self.model.config.eos_token_id)
            except (RuntimeError, OverflowError, TypeError, ValueError) as e:
                raise StepInputError(f"the step's inputs: {e}") from e
        with self.order.work("input_ids"):
            if pending is not None:
                rows, src = pending
                self.decode_in.views(bs)["ids"][rows] = prev.tokens[src]
        self.last_prepare_seconds = time.perf_counter() - self._t0
        with self.order.work("replay"), self._guarded():
            if bs in self.graphs:
                graph, logits, ops = self.graphs[bs]
                collectives.replay(graph, bs, ops, self.tp.group)
                return logits[:n], sampling
            return self._forward_decode(bs, width)[:n], sampling

    @contextlib.contextmanager
    def _guarded(self):
        """The race guard (if on) around a replay of the fixed buffers: snapshot before, count changes after."""
        if self.guard is None:
            yield
            return
        self.guard.before()
        yield
        self.guard.after()

    def _forward_decode(self, bs: int, width: int | None = None) -> torch.Tensor:
        """Logits [bs, V] of the decode batch in the static buffers. `width` (eager only) limits the block
        table to the pages in use, so the reference kernel does not gather the whole context length."""
        inputs = self.decode_in.views(bs)
        ctx = BlockTableDecode(self.pool.k_cache, self.pool.v_cache, inputs["slots"],
                               self.block_table_BP[:bs, :width], inputs["seq_lens"], self.pool.page_size, self.kernel)
        hidden = self.model(inputs["ids"], inputs["positions"], ctx)
        return self.model.compute_logits(hidden, float32=False)

    def _capture(self) -> None:
        """One graph per batch size and per mixed step size, largest first, sharing one memory pool. Padding
        rows (seq_len 0, or the empty padding sequence) write only to the scratch slot, so capturing with
        zeroed buffers touches no request's KV."""
        self.slots_B.fill_(self.pool.scratch_slot)
        for bs in self.batch_sizes:
            self.decode_in.views(bs)["slots"].fill_(self.pool.scratch_slot)
        if self.mixed_sizes:
            self.tiles_2N[0].fill_(self.pad_seq)  # every tile on the padding sequence
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(stream):
            for graphs, sizes, forward in ((self.graphs, self.batch_sizes, self._forward_decode),
                                           (self.mixed_graphs, self.mixed_sizes, self._forward_mixed)):
                for n in reversed(sizes):
                    forward(n)  # warm-up: Triton compiles, cuBLAS picks its kernels
                    graph = torch.cuda.CUDAGraph()
                    with collectives.capturing() as ops, torch.cuda.graph(graph, pool=pool, stream=stream):
                        out = forward(n)
                    graphs[n] = (graph, out, ops)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured CUDA graphs: decode batch sizes %s, mixed step sizes %s", self.batch_sizes,
                 self.mixed_sizes)

    @torch.inference_mode()
    def _compile_eager_kernels(self) -> None:
        """Compile (and load) at start-up the kernels that steps outside the graphs launch, so that no request
        waits for that mid-run: the prefill kernel as a step larger than the graphs' sizes runs it, and the
        sampler's paths (the fused Triton pass; filters, banned tokens and top logprobs through PyTorch), one
        launch each on scratch inputs (reading page 0, writing nothing the engine keeps). Their varying arguments
        compile no variants of their own (`tandem.kernels.fused.varying`; `benchmarks/jit_variants.py`)."""
        attn = self.model.model.layers[0].self_attn  # (this rank's heads)
        k, v = self.pool.k_cache[0], self.pool.v_cache[0]
        ints = functools.partial(torch.tensor, dtype=torch.int32, device=self.device)
        q = torch.zeros(1, attn.num_heads, attn.head_dim, dtype=k.dtype, device=self.device)
        self.prefill_kernel(q, k, v, ints([[0]]), ints([0, 1]), ints([1]), self.pool.page_size, 1.0, 1)
        logits = torch.zeros(2, self.model.config.vocab_size, dtype=k.dtype, device=self.device)  # (the model's)
        zeros = functools.partial(torch.zeros, 2, device=self.device)
        longs = functools.partial(zeros, dtype=torch.long)
        batch = SamplingBatch(zeros() + 1, zeros() + 0.9, longs() + 5, zeros() + 0.05, longs(), longs(),
                              needs_filter=True, banned=(longs()[:1], longs()[:1]), top_logprobs_num=2)
        sample(logits, batch)
        top_logprobs(logits, batch)
        sample(logits, SamplingBatch(batch.temperatures, batch.top_ps, batch.top_ks, batch.min_ps, batch.seeds,
                                     batch.positions, needs_filter=False))

    # ---- prefill and mixed steps: fixed shapes (graphs on CUDA) up to max_graph_tokens, else eager ---------
    def _flatten(self, chunks: list[Chunk]) -> tuple[list[int], list[int], list[int], list[tuple[int, int]]]:
        """The step's (input ids, positions, rows to sample, pending rows) over its chunks' tokens in order."""
        ids, positions, sample_rows, pending = [], [], [], []
        row = 0
        for c in chunks:
            end = c.start + c.num_tokens
            ids.extend(self._pending(row + i, c.req, t, pending) for i, t in enumerate(c.req.tokens[c.start:end]))
            positions.extend(range(c.start, end))
            row += c.num_tokens
            if c.sample:
                sample_rows.append(row - 1)
        return ids, positions, sample_rows, pending

    def _mixed(self, chunks: list[Chunk], prev: Launched | None, sampling_reqs) -> tuple[torch.Tensor | None,
                                                                                          SamplingBatch | None]:
        with self.order.work("sampling_params"):
            sampling = self._sampling(sampling_reqs)
        ids, positions, sample_rows, pending = self._flatten(chunks)
        with self.order.work("eager_inputs"):
            ctx = self._kernel_context(chunks) if self.prefill_kernel is not None else self._reference_context(chunks)
            inputs = self._input_ids(ids, pending, prev), self._to_device(positions)
            rows = self._to_device(sample_rows) if sample_rows else None
        self.last_prepare_seconds = time.perf_counter() - self._t0
        with self.order.work("forward"):
            hidden = self.model(*inputs, ctx)
            return None if rows is None else self.model.compute_logits(hidden[rows], float32=False), sampling

    def _mixed_static(self, chunks: list[Chunk], prev: Launched | None, sampling_reqs) -> tuple[
            torch.Tensor | None, SamplingBatch | None]:
        """The step in the fixed buffers of the next mixed size up: padding tokens write the scratch slot,
        sequences past the step's have empty chunks, and the kernel's tiles past the step's point at one."""
        ids, positions, sample_rows, pending = self._flatten(chunks)
        n, S = len(ids), self.pad_seq
        size = self.mixed_sizes[bisect.bisect_left(self.mixed_sizes, n)]
        pad = size - n
        slots, q_starts, kv_lens, table = self._chunk_layout(chunks)
        host = {
            "positions": torch.tensor(positions + [0] * pad),
            "slots": torch.tensor(slots + [self.pool.scratch_slot] * pad),
            "q_starts": torch.tensor(q_starts + [n] * (S + 2 - len(q_starts)), dtype=torch.int32),
            "kv_lens": torch.tensor(kv_lens, dtype=torch.int32),
            "tiles": self.fill_tiles([c.num_tokens for c in chunks], self.block_m, self.num_tiles[size], pad_seq=S),
        }
        with self.order.work("step_inputs"):
            sampling = self._sampling(sampling_reqs)
            self._input_ids(ids + [0] * pad, [], prev, out=self.ids_B[:size])
            self.positions_B[:size].copy_(self._pinned(host["positions"]), non_blocking=True)
            self.slots_B[:size].copy_(self._pinned(host["slots"]), non_blocking=True)
            self.q_starts_S1.copy_(self._pinned(host["q_starts"]), non_blocking=True)
            self.seq_lens_B[:len(chunks)].copy_(self._pinned(host["kv_lens"]), non_blocking=True)
            self.tiles_2N[:, :self.num_tiles[size]].copy_(self._pinned(host["tiles"]), non_blocking=True)
            self.block_table_BP[:len(chunks), :table.shape[1]].copy_(self._pinned(table), non_blocking=True)
        with self.order.work("input_ids"):
            self._gather_pending(self.ids_B, pending, prev)
        self.last_prepare_seconds = time.perf_counter() - self._t0
        with self.order.work("replay"):
            rows = self._to_device(sample_rows) if sample_rows else None
            with self._guarded():
                if size in self.mixed_graphs:
                    graph, hidden, ops = self.mixed_graphs[size]
                    collectives.replay(graph, size, ops, self.tp.group)
                else:
                    hidden = self._forward_mixed(size)
            return None if rows is None else self.model.compute_logits(hidden[rows], float32=False), sampling

    def _forward_mixed(self, size: int) -> torch.Tensor:
        """Hidden states [size, E] of the mixed step in the static buffers."""
        S = self.pad_seq
        kernel = functools.partial(self.prefill_kernel, tiles_2N=self.tiles_2N[:, :self.num_tiles[size]])
        ctx = BlockTablePrefill(self.pool.k_cache, self.pool.v_cache, self.slots_B[:size], self.block_table_BP[:S + 1],
                                self.q_starts_S1, self.seq_lens_B[:S + 1], self.pool.page_size, 0, kernel)
        return self.model(self.ids_B[:size], self.positions_B[:size], ctx)

    def _chunk_layout(self, chunks: list[Chunk]) -> tuple[list[int], list[int], list[int], torch.Tensor]:
        """For the prefill kernel: the chunks' new slots, query starts (cumulative, from 0), KV lengths, and block
        table (as many columns as the longest needs)."""
        page_size = self.pool.page_size
        new_slots = [c.req.pages[p // page_size] * page_size + p % page_size
                     for c in chunks for p in range(c.start, c.start + c.num_tokens)]
        q_starts = list(itertools.accumulate((c.num_tokens for c in chunks), initial=0))
        width = max(cdiv(c.start + c.num_tokens, page_size) for c in chunks)
        kv_lens = [c.start + c.num_tokens for c in chunks]
        return new_slots, q_starts, kv_lens, block_table([c.req for c in chunks], width)

    def _kernel_context(self, chunks: list[Chunk]) -> BlockTablePrefill:
        """The step over block tables built on the host and copied without waiting for the device."""
        new_slots, q_starts, kv_lens, table = self._chunk_layout(chunks)
        return BlockTablePrefill(self.pool.k_cache, self.pool.v_cache, self._to_device(new_slots),
                                 self._to_device(table), self._to_device(q_starts, torch.int32),
                                 self._to_device(kv_lens, torch.int32), self.pool.page_size,
                                 max(c.num_tokens for c in chunks), self.prefill_kernel)

    def _reference_context(self, chunks: list[Chunk]) -> PagedAttention:
        """The PyTorch reference: every chunk's slots, its decode rows through the decode kernel on a GPU."""
        kv_slots = [self.pool.slots(c.req.pages, 0, c.start + c.num_tokens, device=self.device) for c in chunks]
        ctx = PagedAttention(self.pool.k_cache, self.pool.v_cache,
                             torch.cat([s[c.start:] for c, s in zip(chunks, kv_slots, strict=True)]),
                             q_lens=[c.num_tokens for c in chunks], kv_lens=[c.start + c.num_tokens for c in chunks],
                             kv_slots=kv_slots)
        decodes = [c for c in chunks if c.num_tokens == 1]
        if decodes and self.kernel is not paged_decode_reference:  # GPU: no gather of every decode's context
            width = max(cdiv(c.start + 1, self.pool.page_size) for c in decodes)
            ctx.decode_kernel, ctx.page_size = self.kernel, self.pool.page_size
            ctx.decode_block_table = self._to_device(block_table([c.req for c in decodes], width))
        return ctx

    def check_inputs(self, req: Request) -> str | None:
        """What makes `req`'s own step inputs unbuildable (its sampling parameters as tensors, its token ids), or
        None. Used to find which requests failed a step, so that only they fail."""
        try:
            self._sampling_tensors([req])
        except (RuntimeError, OverflowError, TypeError, ValueError) as e:
            return f"sampling parameters: {e}"
        vocab = self.model.config.vocab_size
        if bad := [t for t in req.tokens if t != PENDING and not (isinstance(t, int) and 0 <= t < vocab)]:
            return f"token ids {bad[:3]} outside [0, {vocab})"
        return None

    @staticmethod
    def _sampling_tensors(reqs) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-request sampling parameters on the host: floats [3, B] and integers [3, B]."""
        floats = torch.tensor([[r.sampling.temperature for r in reqs], [r.sampling.top_p for r in reqs],
                               [r.sampling.min_p for r in reqs]], dtype=torch.float32)
        ints = torch.tensor([[r.sampling.top_k for r in reqs], [r.seed for r in reqs],
                             [r.num_generated for r in reqs]], dtype=torch.int64)
        return floats, ints

    def _sampling_batch(self, reqs) -> SamplingBatch:
        """Per-request sampling parameters on the device: two host-to-device copies (floats, integers)."""
        floats, ints = map(self._to_device, self._sampling_tensors(reqs))
        return with_requests(SamplingBatch(
            temperatures=floats[0], top_ps=floats[1], min_ps=floats[2], top_ks=ints[0], seeds=ints[1],
            positions=ints[2],
            needs_filter=any(0 < r.sampling.top_k < self.model.config.vocab_size or r.sampling.top_p < 1
                             or r.sampling.min_p > 0 for r in reqs),
        ), reqs, self.model.config.eos_token_id)
