"""The Triton paged prefill kernel against a plain PyTorch reference (gather by block table, causal mask offset
by the cached prefix, fp32 softmax).

Without CUDA the kernel runs under Triton's CPU interpreter, so those cases stay tiny (small block sizes are
passed so that chunks still span several query and KV blocks); the `gpu` cases run larger shapes with the
default blocks. Every slot no sequence may read (page 0, which padded block-table entries point to, the tail of
each sequence's last page, spare pages) holds NaN, so any read past a sequence's end shows up as NaN.
"""

import os

import pytest
import torch
from paged_cases import LAYER, scattered_cache

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so before the import
pytest.importorskip("triton")

from tandem.kernels.prefill_attention import fill_tiles, max_tiles, paged_prefill_attention  # noqa: E402
from tandem.model.attention import PagedAttention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_case(q_lens, kv_lens, num_kv_heads, group, head_dim, page_size, dtype, seed=0, device=DEVICE):
    """Random q and caches for sequences with chunks of `q_lens` new tokens over `kv_lens` positions in all;
    each sequence's pages are scattered over the pool, page 0 is never used, unused slots hold NaN."""
    assert all(0 <= q <= kv for q, kv in zip(q_lens, kv_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_table = scattered_cache(kv_lens, num_kv_heads, head_dim, page_size, gen)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen)
    q_starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int()
    kv_lens = torch.tensor(kv_lens, dtype=torch.int32)
    tensors = (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), block_table, q_starts, kv_lens)
    return [t.to(device) for t in tensors]


def reference(q_THD, k_cache_SKD, v_cache_SKD, block_table_BP, q_starts_B1, kv_lens_B, page_size, scale):
    T, H, D = q_THD.shape
    group = H // k_cache_SKD.shape[1]
    out = torch.zeros(T, H, D, dtype=torch.float32)
    for b in range(kv_lens_B.shape[0]):
        start, stop, kv = int(q_starts_B1[b]), int(q_starts_B1[b + 1]), int(kv_lens_B[b])
        n = stop - start
        if n == 0:
            continue
        pos = torch.arange(kv, device=q_THD.device)
        slots = block_table_BP[b, pos // page_size].long() * page_size + pos % page_size
        k_LHD = k_cache_SKD[slots].float().repeat_interleave(group, dim=1)
        v_LHD = v_cache_SKD[slots].float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(kv - n, kv, device=q_THD.device)
        mask_QL = pos[None, :] <= q_pos[:, None]
        scores_HQL = torch.einsum("qhd,lhd->hql", q_THD[start:stop].float(), k_LHD) * scale
        probs_HQL = scores_HQL.masked_fill(~mask_QL, float("-inf")).softmax(-1)
        out[start:stop] = torch.einsum("hql,lhd->qhd", probs_HQL, v_LHD).cpu()
    return out


def check(q_lens, kv_lens, num_kv_heads, group, head_dim, page_size, dtype, block_m=None, block_n=None, seed=0):
    q, k_cache, v_cache, block_table, q_starts, lens = make_case(q_lens, kv_lens, num_kv_heads, group, head_dim,
                                                                 page_size, dtype, seed)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(q, k_cache[LAYER], v_cache[LAYER], block_table, q_starts, lens, page_size,
                                  scale, max_q_len=max(q_lens), block_m=block_m, block_n=block_n)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    want = reference(q, k_cache[LAYER], v_cache[LAYER], block_table, q_starts, lens, page_size, scale)
    torch.testing.assert_close(out.float().cpu(), want, **TOLERANCE[dtype])


# (q_lens, kv_lens, num_kv_heads, group, head_dim, page_size, dtype, block_m, block_n): tiny for the interpreter
SMALL_CASES = [
    # no prefix; chunk of 37 > block_m 16 (three query blocks, the last partial); a single-token sequence
    ([37, 1], [37, 1], 2, 1, 64, 16, torch.float32, 16, 16),
    # prefixes not page-aligned (5, 21), an aligned one (16), q_len 1 over a prefix; GQA 4 (4 tokens a block)
    ([3, 9, 1], [8, 30, 17], 1, 4, 64, 16, torch.float32, 4, 16),
    # head_dim 128, page 32, a long prefix read in unmasked blocks, then a chunk spanning query blocks
    ([20, 2], [70, 33], 1, 4, 128, 32, torch.float32, 8, 16),
    # bf16, page 64, a padding row (q_len 0), default blocks
    ([5, 0, 12], [40, 3, 12], 2, 4, 64, 64, torch.bfloat16, None, None),
    # bf16, GQA 1, head_dim 128, block_n larger than a page
    ([18, 1], [50, 7], 2, 1, 128, 16, torch.bfloat16, 16, 32),
    # default blocks (128 tokens for GQA 1): a chunk of 130 spans two, over a 3-token prefix
    ([130], [133], 1, 1, 64, 16, torch.float32, None, None),
    # fp32, head_dim 128, page 64, GQA 4 with default blocks (32 tokens): chunk 33 over an unaligned prefix
    ([33, 1], [100, 65], 1, 4, 128, 64, torch.float32, None, None),
]


@pytest.mark.parametrize("case", SMALL_CASES,
                         ids=lambda c: f"B{len(c[0])}-K{c[2]}-G{c[3]}-D{c[4]}-P{c[5]}-{str(c[6])[6:]}")
def test_matches_reference_small(case):
    check(*case)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_any_even_head_dim_matches_reference(head_dim):
    """Head dims that are not powers of two run in a padded block whose extra lanes are masked: a lane read past
    the head would read the next head's keys or a NaN slot."""
    check([5, 1], [9, 17], 2, 2, head_dim, 16, torch.float32, block_m=4, block_n=16)


def test_matches_engine_paged_attention():
    """The engine's PyTorch context writes each chunk's new K/V, then attends; the kernel, given the cache it
    wrote, agrees (the contract of a GPU `attend`: write the new slots, then call the kernel)."""
    q_lens, kv_lens, num_kv_heads, head_dim, page_size = [6, 1, 11], [6, 17, 30], 2, 64, 16
    q, k_cache, v_cache, block_table, q_starts, lens = make_case(q_lens, kv_lens, num_kv_heads, 2, head_dim,
                                                                 page_size, torch.float32)
    k_cache.nan_to_num_(0.0), v_cache.nan_to_num_(0.0)  # the PyTorch context's padded gather reads slot 0
    kv_slots = [block_table[b, torch.arange(n, device=DEVICE) // page_size].long() * page_size
                + torch.arange(n, device=DEVICE) % page_size for b, n in enumerate(kv_lens)]
    new_slots = torch.cat([s[kv - n:] for s, n, kv in zip(kv_slots, q_lens, kv_lens, strict=True)])
    ctx = PagedAttention(k_cache, v_cache, new_slots, q_lens=q_lens, kv_lens=kv_lens, kv_slots=kv_slots)
    new_k, new_v = (torch.randn(sum(q_lens), num_kv_heads, head_dim, device=DEVICE) for _ in range(2))
    want = ctx.attend(LAYER, q, new_k, new_v)
    out = paged_prefill_attention(q, k_cache[LAYER], v_cache[LAYER], block_table, q_starts, lens, page_size,
                                  head_dim ** -0.5, max_q_len=max(q_lens), block_m=8, block_n=16)
    torch.testing.assert_close(out, want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("seed", range(4))
def test_random_batches(seed):
    """Random mixes of chunk lengths and prefixes (zero, aligned or not, q_len 1), page size, GQA and dtype."""
    gen = torch.Generator().manual_seed(100 + seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]  # noqa: E731
    batch = int(torch.randint(1, 5, (1,), generator=gen))
    q_lens = [pick([1, 1, 2, 7, 16, 19]) for _ in range(batch)]
    kv_lens = [q + pick([0, 0, 1, 15, 16, 33]) for q in q_lens]
    check(q_lens, kv_lens, pick([1, 2]), pick([1, 2, 4]), pick([64, 128]), pick([16, 32, 64]),
          pick([torch.float32, torch.bfloat16]), block_m=pick([4, 8, 16]), block_n=pick([16, 32]), seed=seed)


def test_grid_larger_than_needed_and_rows_outside_sequences():
    """max_q_len above every chunk (a stale host bound) only adds programs that exit; rows of q past
    q_starts[B] belong to no sequence and do not disturb the others."""
    q, k_cache, v_cache, block_table, q_starts, lens = make_case([3, 2], [10, 2], 1, 2, 64, 16, torch.float32)
    q = torch.cat([q, torch.randn(2, *q.shape[1:], device=DEVICE)])  # two trailing rows in no sequence
    out = paged_prefill_attention(q, k_cache[LAYER], v_cache[LAYER], block_table, q_starts, lens, 16, 0.125,
                                  max_q_len=40, block_m=8, block_n=16)
    want = reference(q[:5], k_cache[LAYER], v_cache[LAYER], block_table, q_starts, lens, 16, 0.125)
    torch.testing.assert_close(out[:5].cpu(), want, **TOLERANCE[torch.float32])


def test_tile_list_grid_equals_the_reference():
    """The fixed grid of a CUDA graph: a tile list sized for more tokens and sequences than the batch has, its
    spare tiles on an empty padding sequence (the last), gives every chunk's attention; rows past the batch's
    tokens stay unwritten."""
    q_lens, kv_lens = [19, 1, 5, 0], [40, 17, 5, 0]  # (the last sequence is the padding one)
    q, k_cache, v_cache, block_table, q_starts, lens = make_case(q_lens, kv_lens, 1, 2, 64, 16, torch.float32)
    num_tiles = max_tiles(64, 8, block_m=8)
    tiles = fill_tiles(q_lens, 8, num_tiles, pad_seq=3)
    assert tiles.shape == (2, num_tiles) and tiles[:, :5].tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 0, 0]]
    assert (tiles[0, 5:] == 3).all()
    q = torch.cat([q, torch.full((4, *q.shape[1:]), float("nan"), device=DEVICE)])  # rows in no sequence
    out = paged_prefill_attention(q, k_cache[LAYER], v_cache[LAYER], block_table, q_starts, lens, 16, 0.125,
                                  max_q_len=0, block_m=8, block_n=16, tiles_2N=tiles.to(DEVICE))
    want = reference(q[:25], k_cache[LAYER], v_cache[LAYER], block_table, q_starts, lens, 16, 0.125)
    torch.testing.assert_close(out[:25].cpu(), want, **TOLERANCE[torch.float32])
    with pytest.raises(AssertionError, match="do not fit"):
        fill_tiles(q_lens, 8, 4, pad_seq=3)


GPU_CASES = [
    # (q_lens, kv_lens, num_kv_heads, group, head_dim, page_size, dtype)
    ([1000], [1000], 8, 2, 128, 16, torch.bfloat16),
    ([300, 1, 517], [1300, 77, 517], 2, 4, 128, 16, torch.float32),
    ([129, 128, 127, 0], [200, 128, 999, 5], 4, 1, 64, 32, torch.bfloat16),
    ([64, 1, 250], [1000, 31, 251], 2, 4, 64, 32, torch.float32),
    ([513, 7], [2049, 7], 1, 8, 128, 64, torch.bfloat16),
    ([2048, 33, 1], [2048, 600, 1], 2, 3, 128, 64, torch.bfloat16),  # a group that is not a power of two
]
_GEN = torch.Generator().manual_seed(1)
_Q = [int(n) for n in torch.randint(0, 400, (17,), generator=_GEN)]
GPU_CASES.append((_Q, [q + int(p) for q, p in zip(_Q, torch.randint(0, 700, (17,), generator=_GEN),
                                                   strict=True)], 8, 2, 128, 16, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", [(None, None), (16, 16), (8, 32)], ids=lambda b: f"bm{b[0]}-bn{b[1]}")
@pytest.mark.parametrize("case", GPU_CASES,
                         ids=lambda c: f"B{len(c[0])}-K{c[2]}-G{c[3]}-D{c[4]}-P{c[5]}-{str(c[6])[6:]}")
def test_matches_reference_gpu(case, blocks):
    check(*case, *blocks)


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_chunks():
    """Captured once with a host bound on q_len, replayed for two different batches (sequences 0-2 of one pool,
    then 3-5) written into the same q, block-table, q-start and length buffers: the graph must follow them."""
    page_size, scale, max_q = 16, 128 ** -0.5, 64
    q_lens, kv_lens = [64, 5, 30, 1, 40, 23], [64, 300, 700, 900, 40, 100]
    all_q, k_cache, v_cache, all_table, all_starts, all_lens = make_case(q_lens, kv_lens, 8, 2, 128, page_size,
                                                                         torch.bfloat16)
    q = torch.zeros(max(sum(q_lens[:3]), sum(q_lens[3:])), *all_q.shape[1:], dtype=all_q.dtype, device=DEVICE)
    block_table, q_starts, lens = all_table[:3].clone(), all_starts[:4].clone(), all_lens[:3].clone()

    def run():
        return paged_prefill_attention(q, k_cache[LAYER], v_cache[LAYER], block_table, q_starts, lens, page_size,
                                       scale, max_q_len=max_q)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for first in (0, 3):
        rows = slice(first, first + 3)
        tokens = slice(int(all_starts[first]), int(all_starts[first + 3]))
        n = tokens.stop - tokens.start
        q.zero_()
        q[:n].copy_(all_q[tokens])
        block_table.copy_(all_table[rows])
        q_starts.copy_(all_starts[first:first + 4] - all_starts[first])
        lens.copy_(all_lens[rows])
        graph.replay()
        want = reference(q[:n], k_cache[LAYER], v_cache[LAYER], block_table, q_starts, lens, page_size, scale)
        assert torch.isfinite(out[:n]).all()
        torch.testing.assert_close(out[:n].float().cpu(), want, **TOLERANCE[torch.bfloat16])


def test_engine_steps_through_the_prefill_kernel_equal_the_reference_path():
    """Whole engine steps (chunked prefill, prefix-cache hits with a partial page, prefill chunks beside
    decodes) through `BlockTablePrefill` and the kernel give the reference path's tokens and logprobs."""
    import asyncio

    from tandem.config import EngineConfig
    from tandem.engine.engine import Engine
    from tandem.types import SamplingParams

    prefix = list(range(3, 40))
    prompts = [prefix + [50, 51], prefix + [60], list(range(100, 131)), [7, 8, 9]]
    sp = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    config = EngineConfig(page_size=8, num_pages=64, max_prefill_tokens=24, device=DEVICE)
    results = []
    for kernel in (None, paged_prefill_attention):
        with Engine("tiny", config) as engine:
            engine.runner.prefill_kernel = kernel

            async def go(engine=engine):
                first = await engine.generate(prompts[0], sp)  # then a prefix hit beside a longer prefill
                return [first] + list(await asyncio.gather(*[engine.generate(p, sp) for p in prompts[1:]]))

            outs = asyncio.run(go())
            results.append([(o.output_ids, o.output_logprobs, o.cached_tokens) for o in outs])
    (ref, kernel_outs) = results
    assert [r[2] for r in ref] == [0, 37, 0, 0]
    for (ids, lps, cached), (ids_k, lps_k, cached_k) in zip(ref, kernel_outs, strict=True):
        assert ids_k == ids and cached_k == cached
        assert lps_k == pytest.approx(lps, abs=1e-4)


@pytest.mark.parametrize("max_graph_tokens", [20, 4096])
def test_engine_steps_in_the_fixed_mixed_buffers_equal_the_reference_path(monkeypatch, max_graph_tokens):
    """Steps that prefill, run in the fixed buffers a CUDA graph captures (padded tokens, empty padding
    sequences, a tile list; eagerly here), give the reference path's tokens and logprobs. At 20 tokens, larger
    steps take the eager kernel path beside them."""
    import asyncio

    from tandem.config import EngineConfig
    from tandem.engine import model_runner
    from tandem.engine.engine import Engine
    from tandem.model.attention import paged_decode_reference
    from tandem.types import SamplingParams

    prefix = list(range(3, 40))
    prompts = [prefix + [50, 51], prefix + [60], list(range(100, 131)), [7, 8, 9], list(range(200, 213))]
    sp = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    config = EngineConfig(page_size=8, num_pages=64, max_prefill_tokens=24, max_running_requests=8, device=DEVICE,
                          prefill_graph_max_tokens=max_graph_tokens)

    def run(engine):
        async def go():
            first = await engine.generate(prompts[0], sp)
            return [first] + list(await asyncio.gather(*[engine.generate(p, sp) for p in prompts[1:]]))
        return [(o.output_ids, o.output_logprobs, o.cached_tokens) for o in asyncio.run(go())]

    with Engine("tiny", config) as engine:
        ref = run(engine)  # (on CPU: the reference context)
    monkeypatch.setattr(model_runner, "_kernels", lambda device, enabled: (paged_decode_reference,
                                                                           paged_prefill_attention))
    sizes, eager = [], []
    with Engine("tiny", config) as engine:
        runner = engine.runner
        assert runner.mixed_sizes == ([16, 20] if max_graph_tokens == 20 else [16, 32])
        forward, mixed = runner._forward_mixed, runner._mixed
        monkeypatch.setattr(runner, "_forward_mixed", lambda size: sizes.append(size) or forward(size))
        monkeypatch.setattr(runner, "_mixed", lambda chunks, *rest: eager.append(chunks) or mixed(chunks, *rest))
        got = run(engine)
    assert 16 in sizes and bool(eager) == (max_graph_tokens == 20), (sizes, len(eager))
    assert max_graph_tokens == 20 or 32 in sizes, sizes
    for (ids, lps, cached), (ids_s, lps_s, cached_s) in zip(ref, got, strict=True):
        assert ids_s == ids and cached_s == cached
        assert lps_s == pytest.approx(lps, abs=1e-4)


def test_the_fused_model_writes_keys_and_values_into_the_cache_as_the_contexts_did(monkeypatch):
    """With fused kernels the q/k-norm + RoPE kernel writes each step's keys and values straight into the KV cache
    (decode and prefill contexts, fixed buffers) instead of the contexts' own copies after it: the same tokens, and
    logprobs within rounding of both the contexts' path and the reference path (the concurrent requests' batches
    depend on arrival timing, and a different batch rounds differently)."""
    import asyncio

    from tandem.config import EngineConfig, ModelConfig
    from tandem.engine import model_runner
    from tandem.engine.engine import Engine
    from tandem.kernels import fused
    from tandem.model.attention import BlockTableDecode, BlockTablePrefill, paged_decode_reference
    from tandem.types import SamplingParams

    shape = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                        rope_theta=10_000.0, eos_token_id=1)  # a head dim the fused kernel takes
    prefix = list(range(3, 40))
    prompts = [prefix + [50, 51], prefix + [60], list(range(100, 131)), [7, 8, 9]]
    # (three tokens: each wave of requests still prefills in chunks, the second wave in a mixed step, then decodes
    # two steps through the few-row kernels; each step costs most of a second under the Triton interpreter)
    sp = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    config = EngineConfig(page_size=8, num_pages=64, max_prefill_tokens=24, max_running_requests=8, device=DEVICE,
                          prefill_graph_max_tokens=20)
    calls = {"to the cache": 0, "returned": 0}
    qk_norm_rope = fused.qk_norm_rope

    def counted(*args, kv_cache=None):
        calls["returned" if kv_cache is None else "to the cache"] += 1
        return qk_norm_rope(*args, kv_cache=kv_cache)

    def run(fuse: bool):
        with Engine(shape, config) as engine:
            if fuse:
                engine.model.use_fused_kernels()

            async def go():
                first = await engine.generate(prompts[0], sp)
                return [first] + list(await asyncio.gather(*[engine.generate(p, sp) for p in prompts[1:]]))
            return [(o.output_ids, o.output_logprobs, o.cached_tokens) for o in asyncio.run(go())]

    reference_outs = run(fuse=False)
    monkeypatch.setattr(model_runner, "_kernels", lambda device, enabled: (paged_decode_reference,
                                                                           paged_prefill_attention))
    monkeypatch.setattr(fused, "qk_norm_rope", counted)
    direct = run(fuse=True)
    assert calls["to the cache"] > 0 and calls["returned"] == 0, calls
    for context in (BlockTableDecode, BlockTablePrefill):
        monkeypatch.setattr(context, "kv_destination", lambda self, layer: None)
    via_contexts = run(fuse=True)
    assert calls["returned"] > 0, calls
    for (ids, lps, cached), (ids_f, lps_f, cached_f), (ids_c, lps_c, cached_c) in zip(
            reference_outs, direct, via_contexts, strict=True):
        assert ids_f == ids_c == ids and cached_f == cached_c == cached
        assert lps_f == pytest.approx(lps_c, abs=1e-5)
        assert lps_f == pytest.approx(lps, abs=1e-4)
