"""The fused Triton kernels (`tandem.kernels.fused`, `tandem.kernels.sampling`) against the PyTorch code they
replace: the model's `RMSNorm`, `rope_cos_sin` + `apply_rope`, `F.silu(gate) * up`, and the engine's `sample`.

Without CUDA the kernels run under Triton's CPU interpreter, so those cases stay tiny; the `gpu` cases run the
model's real shapes (hidden 1024 / 4096 / 8192, vocabulary 151936, batch 256) and a CUDA-graph replay.
Sampled tokens must equal `sample`'s exactly; activations must agree to fp32 rounding in fp32 and (almost
everywhere) bit for bit in bf16, where a differently ordered sum of squares may tip a rounding by one ulp.
"""

import functools
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so before the import
pytest.importorskip("triton")

from tandem.engine.sampler import SamplingBatch, hash_uniform, sample  # noqa: E402
from tandem.kernels.fused import fused_add_rmsnorm, qk_norm_rope, rmsnorm, silu_mul, silu_mul_merged  # noqa: E402
from tandem.kernels.sampling import sample_gumbel  # noqa: E402
from tandem.kernels.small_linear import (  # noqa: E402
    MAX_ROWS,
    VECTOR_ROWS,
    Blocks,
    arrival_counts,
    default_blocks,
    small_qkv,
    takes_heads,
)
from tandem.kernels.small_linear import small_linear as split_linear  # noqa: E402
from tandem.model.qwen3 import RMSNorm, apply_rope, rope_cos_sin  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS, THETA = 1e-6, 1_000_000.0
DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def assert_bits(out, want, fp32_tol=1e-5, bf16_atol=1e-5, max_bf16_mismatch=0.001):
    """fp32: equal to rounding; bf16: within an ulp or two everywhere and bit-equal almost everywhere."""
    assert out.shape == want.shape and out.dtype == want.dtype, (out.shape, want.shape, out.dtype, want.dtype)
    assert torch.isfinite(out).all()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=fp32_tol, atol=fp32_tol)
    else:
        torch.testing.assert_close(out.float(), want.float(), rtol=1.6e-2, atol=bf16_atol)
        assert (out != want).sum().item() <= max_bf16_mismatch * out.numel()


assert_matches = assert_bits


def norm_module(dim, dtype, seed):
    norm = RMSNorm(dim, EPS).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * randn(dim, seed=seed))
    return norm


# ------------------------------------------------------------------------------------------------------- RMSNorm


def check_rmsnorm(T, E, dtype, row_stride_pad=0):
    norm = norm_module(E, dtype, seed=1)
    x = randn(T, E + row_stride_pad, dtype=dtype, scale=3.0)[:, :E]  # a strided view when padded
    with torch.no_grad():
        assert_matches(rmsnorm(x, norm.weight, EPS), norm(x))


def check_fused_add_rmsnorm(T, E, dtype):
    norm = norm_module(E, dtype, seed=1)
    x, residual = randn(T, E, dtype=dtype, seed=2), randn(T, E, dtype=dtype, seed=3, scale=4.0)
    want_residual = residual + x  # the model's `x = x + sublayer(x)`, rounded to the dtype
    with torch.no_grad():
        want_y = norm(want_residual)
        y, new_residual = fused_add_rmsnorm(x, residual, norm.weight, EPS)
    assert new_residual.data_ptr() == residual.data_ptr()  # written in place
    torch.testing.assert_close(new_residual, want_residual, rtol=0, atol=0)  # one rounded add: bit-exact
    assert_matches(y, want_y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,E,pad", [(3, 64, 0), (2, 100, 28), (0, 64, 0)])
def test_rmsnorm_small(T, E, pad, dtype):
    check_rmsnorm(T, E, dtype, pad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,E", [(3, 64), (2, 96), (0, 32)])
def test_fused_add_rmsnorm_small(T, E, dtype):
    check_fused_add_rmsnorm(T, E, dtype)


# ------------------------------------------------------------------------------------------------- q/k norm + RoPE


def check_qk_norm_rope(positions, H, K, D, dtype):
    T = len(positions)
    positions = torch.tensor(positions, dtype=torch.int64, device=DEVICE)
    q_norm, k_norm = norm_module(D, dtype, seed=4), norm_module(D, dtype, seed=5)
    qkv = randn(T, (H + 2 * K) * D, dtype=dtype, seed=6, scale=2.0)  # q and k as views of a fused projection
    q, k = qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + K) * D].view(T, K, D)
    cos, sin = rope_cos_sin(positions, D, THETA)
    with torch.no_grad():
        want_q, want_k = apply_rope(q_norm(q), cos, sin), apply_rope(k_norm(k), cos, sin)
        out_q, out_k = qk_norm_rope(q, k, q_norm.weight, k_norm.weight, positions, THETA, EPS)
    # RoPE's `x1 * cos - x2 * sin` may cancel: an ulp of a normalised input is an absolute error in the output
    assert_matches(out_q, want_q, bf16_atol=2**-6)
    assert_matches(out_k, want_k, bf16_atol=2**-6)
    # keys and values straight into a KV cache, at rows out of order: the same keys, the values as they were
    v = qkv[:, (H + K) * D:].view(T, K, D)
    caches = torch.zeros(2, 2 * T + 3, K, D, dtype=dtype, device=DEVICE)
    slots = torch.randperm(2 * T + 3, generator=torch.Generator().manual_seed(T))[:T].to(DEVICE)
    with torch.no_grad():
        cached_q, no_k = qk_norm_rope(q, k, q_norm.weight, k_norm.weight, positions, THETA, EPS,
                                      kv_cache=(v, caches[0], caches[1], slots))
    assert no_k is None and torch.equal(cached_q, out_q)
    assert torch.equal(caches[0][slots], out_k) and torch.equal(caches[1][slots], v)
    untouched = torch.ones(2 * T + 3, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not caches[:, untouched].any(), "a row no slot names was written"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("positions,H,K,D", [
    ([0, 1, 7, 300], 4, 2, 64),
    ([5, 1023], 2, 1, 128),
    ([3, 9, 11], 3, 3, 64),  # head counts that are not powers of two
    ([], 2, 1, 64),
])
def test_qk_norm_rope_small(positions, H, K, D, dtype):
    check_qk_norm_rope(positions, H, K, D, dtype)


@pytest.mark.parametrize("D", [64, 80, 96, 128])
def test_qk_norm_rope_any_even_head_dim(D):
    """Halves of heads that are not powers of two run in padded blocks whose extra lanes are masked."""
    check_qk_norm_rope([0, 7, 300], 2, 1, D, torch.float32)


# ------------------------------------------------------------------------------------------------------- SiLU * up


def check_silu_mul(T, inter, dtype, block_i=1024):
    gate_up = randn(T, 2 * inter, dtype=dtype, seed=7, scale=3.0)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    want = F.silu(gate) * up
    assert_matches(silu_mul(gate, up, block_i=block_i), want)
    assert_matches(silu_mul_merged(gate_up), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,inter,block_i", [(3, 300, 128), (1, 64, 1024), (0, 64, 1024)])
def test_silu_mul_small(T, inter, block_i, dtype):
    check_silu_mul(T, inter, dtype, block_i)


# -------------------------------------------------------------------------------------------------------- sampling


def make_sampling_case(B, V, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=gen) * 3).to(DEVICE, dtype)
    temps = torch.tensor([(0.0, 1.0, 0.7, 1.5, 0.3)[i % 5] for i in range(B)], device=DEVICE)
    seeds = torch.randint(-2**62, 2**62, (B,), generator=gen).to(DEVICE)  # negative and high bits in use
    positions = torch.randint(0, 40_000, (B,), generator=gen).to(DEVICE)
    return logits, temps, seeds, positions


def reference_sample(logits_BV, temps_B, seeds_B, positions_B):
    """`sample`'s path for rows without truncation, in plain PyTorch (on CUDA `sample` itself runs the kernel)."""
    logits_BV = logits_BV.float()
    greedy = temps_B == 0
    scaled_BV = logits_BV / torch.where(greedy, torch.ones_like(temps_B), temps_B)[:, None]
    gumbel_BV = -torch.log(-torch.log(hash_uniform(seeds_B, positions_B, logits_BV.shape[-1])))
    tokens = torch.where(greedy, torch.argmax(logits_BV, dim=-1), torch.argmax(scaled_BV + gumbel_BV, dim=-1))
    return tokens, torch.log_softmax(scaled_BV, dim=-1).gather(1, tokens[:, None])[:, 0]


def check_sampling(logits, temps, seeds, positions, num_splits=None):
    B = logits.shape[0]
    want_tokens, want_logprobs = reference_sample(logits, temps, seeds, positions)
    if not logits.is_cuda:  # the engine's sampler (the PyTorch path here) is what the reference stands for
        batch = SamplingBatch(temperatures=temps, top_ps=torch.ones(B), top_ks=torch.zeros(B, dtype=torch.int64),
                              min_ps=torch.zeros(B), seeds=seeds, positions=positions, needs_filter=False)
        torch.testing.assert_close(sample(logits, batch), (want_tokens, want_logprobs), rtol=0, atol=0)
    tokens, logprobs = sample_gumbel(logits, temps, seeds, positions, num_splits=num_splits)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=2e-5)


# ------------------------------------------------------------------------------------------- few-row projections


def check_small_linear(T, E, N, dtype, x_pad=0, blocks=None):
    """Each fusion of `small_linear` against the model's own ops, with the projection in fp32 over the same
    rounded inputs (cuBLAS's bf16 products are exact in fp32 too; only the summation order differs, which tips a
    bf16 rounding in a few outputs in a thousand). With `blocks.splits` > 1 the input columns are split over
    programs, and the arrival counts must be left zero for the next launch."""
    arrived = arrival_counts(DEVICE)
    small_linear = functools.partial(split_linear, blocks=blocks, arrived=arrived)
    assert_matches = functools.partial(assert_bits, max_bf16_mismatch=0.005)
    # after a norm, a sum of squares ordered otherwise tips a few normalised inputs by an ulp, and each moves
    # every output a little: up to a few percent of bf16 outputs round the other way at 4,096 columns
    assert_normed = functools.partial(assert_bits, max_bf16_mismatch=0.05)
    norm = norm_module(E, dtype, seed=3)
    x = randn(T, E + x_pad, dtype=dtype, seed=4, scale=2.0)[:, :E]
    w = randn(2 * N, E, dtype=dtype, seed=5, scale=E ** -0.5)

    def linear(a, b):
        return F.linear(a.float(), b.float()).to(dtype)

    with torch.no_grad():
        assert_matches(small_linear(x, w), linear(x, w))
        assert_normed(small_linear(x, w, norm.weight, EPS), linear(norm(x), w))
        residual = randn(T, 2 * N, dtype=dtype, seed=6)
        want = residual + linear(x, w)
        out = residual.clone()
        assert small_linear(x, w, out=out) is out
        if dtype == torch.float32:
            assert_matches(out, want)
        else:  # where residual and projection nearly cancel, a projection's tipped ulp is large against the sum:
            # the bound is that ulp and the sum's rounding, an ulp of the addends' magnitude each
            addends = residual.float().abs() + linear(x, w).float().abs()
            assert ((out.float() - want.float()).abs() <= 2 ** -6 * addends).all()
            assert (out != want).sum().item() <= 0.005 * out.numel()
        gate, up = linear(norm(x), w).chunk(2, dim=-1)
        assert_normed(small_linear(x, w, norm.weight, EPS, silu=True), F.silu(gate) * up)
    assert not arrived.any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,E,N,pad", [(1, 64, 48, 0), (5, 96, 40, 32), (MAX_ROWS, 300, 20, 0), (0, 64, 16, 0)])
def test_small_linear_small(T, E, N, pad, dtype):
    check_small_linear(T, E, N, dtype, pad)


@pytest.mark.parametrize("splits", [2, 3])
def test_small_linear_split_over_input_columns(splits):
    """Input columns split over programs (the last of a column block to arrive adds the partials): 300 columns
    in tiles of 32, so the last split is short."""
    check_small_linear(3, 300, 40, torch.float32, blocks=Blocks(16, 32, splits=splits))
    check_small_linear(2, 300, 24, torch.bfloat16, blocks=Blocks(16, 32, splits=splits))


@pytest.mark.parametrize("T", [1, 2, 3, 5])  # (a row at a time up to `ROWWISE_ROWS`, all together above)
@pytest.mark.parametrize("blocks", [Blocks(4, 64, vector=True), Blocks(8, 32, splits=3, vector=True),
                                    Blocks(4, 128, vector=True)], ids=["unsplit", "split3", "whole-row"])
def test_small_linear_vector_tiles(blocks, T):
    """Products on the CUDA cores, a tile of the rows there are: several column blocks and input tiles, a short
    last tile, split or not, or the whole input row in one tile (the default takes them only up to `VECTOR_ROWS`
    rows, but any count is right)."""
    check_small_linear(T, 100, 20, torch.float32, blocks=blocks)
    check_small_linear(T, 100, 12, torch.bfloat16, blocks=blocks)


def test_vector_blocks_are_whole_rows_or_split_heads():
    """The default tiling below `VECTOR_ROWS` rows: whole input rows a tile unless a program holds a head."""
    cpu = torch.device("cpu")
    assert default_blocks(3072, 1024, cpu, rows=1) == Blocks(8, 1024, stages=1, vector=True)
    assert default_blocks(3072, 1024, cpu, rows=1, paired=True) == Blocks(4, 1024, stages=1, vector=True)
    assert default_blocks(1024, 3072, cpu, rows=VECTOR_ROWS) == Blocks(2, 4096, stages=1, vector=True)
    assert default_blocks(4096, 1024, cpu, heads=32, rows=1) == Blocks(64, 64, stages=1, splits=16, vector=True)
    assert not default_blocks(1024, 3072, cpu, rows=VECTOR_ROWS + 1).vector
    assert not default_blocks(4096, 1024, cpu, heads=32, rows=2).vector


def check_small_qkv(T, E, H, K, D, dtype, blocks=None):
    """`small_qkv` against the unfused chain: rmsnorm, the projection (fp32 over the same rounded inputs), then
    `qk_norm_rope` writing into caches of its own; rows at scattered slots and positions."""
    arrived = arrival_counts(DEVICE)
    x = randn(T, E, dtype=dtype, seed=8, scale=2.0)
    w = randn((H + 2 * K) * D, E, dtype=dtype, seed=9, scale=E ** -0.5)
    norm, q_norm, k_norm = (norm_module(n, dtype, seed=s).weight for s, n in ((10, E), (11, D), (12, D)))
    positions = torch.randint(0, 4000, (T,), generator=torch.Generator().manual_seed(T)).to(DEVICE)
    slots = torch.randperm(2 * T + 3, generator=torch.Generator().manual_seed(1))[:T].to(DEVICE)
    caches = [torch.zeros(2 * T + 3, K, D, dtype=dtype, device=DEVICE) for _ in range(4)]
    with torch.no_grad():
        q = small_qkv(x, w, norm, EPS, q_norm, k_norm, positions, THETA, H, (*caches[:2], slots), arrived, blocks)
        qkv = F.linear(rmsnorm(x, norm, EPS).float(), w.float()).to(dtype)
        q_in, k_in, v_in = qkv.split([H * D, K * D, K * D], dim=-1)
        want, _ = qk_norm_rope(q_in.view(T, H, D), k_in.view(T, K, D), q_norm, k_norm, positions, THETA, EPS,
                               kv_cache=(v_in.view(T, K, D), *caches[2:], slots))
    for out, ref in ((q, want), (caches[0], caches[2]), (caches[1], caches[3])):
        assert_bits(out, ref, max_bf16_mismatch=0.05)  # (after a norm: see check_small_linear)
    assert caches[0][slots].abs().sum() > 0 and not arrived.any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("blocks", [None, Blocks(16, 32, splits=3)], ids=["default", "split3"])
def test_small_qkv_small(blocks, dtype):
    check_small_qkv(3, 96, 4, 2, 64, dtype, blocks)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 2, 3])
def test_small_qkv_vector_tiles(T, dtype):
    """Vector tiles with a head a program, split (by default at one or two rows) and not."""
    check_small_qkv(T, 96, 4, 2, 64, dtype)
    check_small_qkv(T, 96, 4, 2, 64, dtype, Blocks(32, 64, vector=True))


def test_small_linear_refuses_more_rows_than_a_program_holds():
    with pytest.raises(AssertionError, match="at most"):
        split_linear(randn(MAX_ROWS + 1, 32), randn(16, 32))
    assert [takes_heads(d) for d in (64, 80, 96, 128, 256, 16)] == [True, False, False, True, True, False]
    with pytest.raises(AssertionError, match="arrival_counts"):
        split_linear(randn(2, 64), randn(16, 64), blocks=Blocks(16, 32, splits=2))


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sample_gumbel_small(dtype, num_splits):
    check_sampling(*make_sampling_case(6, 5000, dtype=dtype), num_splits=num_splits)


def test_sample_gumbel_noise_is_hash_uniform():
    """Flat logits: every token is the argmax of the hashed uniforms alone, row by row."""
    _, temps, seeds, positions = make_sampling_case(5, 3000, seed=1)
    check_sampling(torch.zeros(5, 3000, device=DEVICE), temps, seeds, positions)


def test_sample_gumbel_greedy_ties_and_empty_batch():
    logits = torch.zeros(2, 4100, device=DEVICE)
    logits[:, [2049, 4099]] = 5.0  # tied maxima in different blocks (and splits): the first wins, as torch.argmax
    zeros = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    tokens, _ = sample_gumbel(logits, torch.zeros(2, device=DEVICE), zeros, zeros, num_splits=2)
    assert tokens.tolist() == [2049, 2049]
    tokens, logprobs = sample_gumbel(logits[:0], torch.zeros(0, device=DEVICE), zeros[:0], zeros[:0])
    assert tokens.shape == logprobs.shape == (0,)


# ------------------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E", [1024, 4096, 5120, 8192])
@pytest.mark.parametrize("T", [1, 7, 2048])
def test_rmsnorm_gpu(T, E, dtype):
    check_rmsnorm(T, E, dtype, row_stride_pad=64)
    check_fused_add_rmsnorm(T, E, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H,K,D", [(16, 8, 128), (32, 8, 128), (40, 8, 128), (14, 2, 64)])
@pytest.mark.parametrize("T", [1, 333])
def test_qk_norm_rope_gpu(T, H, K, D, dtype):
    positions = torch.randint(0, 40_960, (T,), generator=torch.Generator().manual_seed(T)).tolist()
    check_qk_norm_rope(positions, H, K, D, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,inter", [(1, 3072), (257, 12288), (4, 25600)])
def test_silu_mul_gpu(T, inter, dtype):
    check_silu_mul(T, inter, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,num_splits", [(256, None), (1, None), (17, 1), (64, 7)])
def test_sample_gumbel_gpu(B, num_splits, dtype):
    check_sampling(*make_sampling_case(B, 151_936, seed=B, dtype=dtype), num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,E,N", [(1, 1024, 2048), (2, 3072, 1024), (7, 1024, 3072), (16, 2048, 512), (3, 4096, 6144)])
def test_small_linear_gpu(T, E, N, dtype):
    check_small_linear(T, E, N, dtype)  # (split as the model splits it)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,E,H,K", [(1, 1024, 16, 8), (2, 4096, 32, 8), (16, 4096, 32, 8), (5, 2048, 16, 2)])
def test_small_qkv_gpu(T, E, H, K, dtype):
    check_small_qkv(T, E, H, K, 128, dtype)


@pytest.mark.gpu
def test_cuda_graph_replay():
    """All kernels captured in one graph, replayed on new inputs written into the captured buffers."""
    T, E, H, K, D, inter, V = 8, 1024, 16, 8, 128, 3072, 151_936
    dtype = torch.bfloat16
    norm, q_norm, k_norm = norm_module(E, dtype, 1), norm_module(D, dtype, 2), norm_module(D, dtype, 3)
    x, residual = torch.empty(T, E, dtype=dtype, device=DEVICE), torch.empty(T, E, dtype=dtype, device=DEVICE)
    qkv = torch.empty(T, (H + 2 * K) * D, dtype=dtype, device=DEVICE)
    gate_up = torch.empty(T, 2 * inter, dtype=dtype, device=DEVICE)
    positions = torch.empty(T, dtype=torch.int64, device=DEVICE)
    logits, temps, seeds, sample_positions = make_sampling_case(T, V)

    def fill(seed):
        gen = torch.Generator().manual_seed(seed)
        for t in (x, residual, qkv, gate_up, logits):
            t.copy_(torch.randn(t.shape, generator=gen))
        positions.copy_(torch.randint(0, 30_000, (T,), generator=gen))
        seeds.copy_(torch.randint(0, 2**40, (T,), generator=gen))

    def run():
        q, k = qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + K) * D].view(T, K, D)
        y, new_residual = fused_add_rmsnorm(x, residual, norm.weight, EPS)
        return (y, new_residual.clone(), *qk_norm_rope(q, k, q_norm.weight, k_norm.weight, positions, THETA, EPS),
                silu_mul_merged(gate_up), *sample_gumbel(logits, temps, seeds, sample_positions))

    fill(0)
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for seed in (1, 2):
        fill(seed)
        residual_before, x_before = residual.clone(), x.clone()
        graph.replay()
        with torch.no_grad():
            q, k = qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + K) * D].view(T, K, D)
            cos, sin = rope_cos_sin(positions, D, THETA)
            want_residual = residual_before + x_before
            assert_matches(outs[0], norm(want_residual))
            torch.testing.assert_close(outs[1], want_residual, rtol=0, atol=0)
            assert_matches(outs[2], apply_rope(q_norm(q), cos, sin))
            assert_matches(outs[3], apply_rope(k_norm(k), cos, sin))
            assert_matches(outs[4], F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
        check_sampling(logits, temps, seeds, sample_positions)
        assert torch.equal(outs[5], sample_gumbel(logits, temps, seeds, sample_positions)[0])
