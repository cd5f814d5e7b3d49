"""Decode's skinny split-K GEMM (`tandem.kernels.gemm`) against float64 products and cuBLAS.

Without CUDA the kernel runs under Triton's CPU interpreter (tiny shapes); the `gpu` cases run the 0.6B model's
projections, check that a split-K product gives the same bits on every call and inside a CUDA graph, and that
every launch leaves its tickets at zero.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so before the import
pytest.importorskip("triton")

from tandem.kernels import gemm  # noqa: E402
from tandem.kernels.gemm import MAX_ROWS, linear, skinny_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def operands(M, N, K, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=gen).to(DEVICE, dtype),
            (0.05 * torch.randn(N, K, generator=gen)).to(DEVICE, dtype))


def assert_rounded_product(y, x, w):
    """y is x @ w.T summed in fp32 and rounded once: off the exact sum by at most the fp32 sum's error (bounded
    by 1e-4 of the sum of the terms' magnitudes) plus, in bf16, one output ulp."""
    exact = x.double() @ w.double().T
    assert y.dtype == x.dtype and y.shape == exact.shape
    bound = 1e-4 * (x.double().abs() @ w.double().abs().T)
    if y.dtype == torch.bfloat16:
        bound += torch.finfo(torch.bfloat16).eps * exact.abs()
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M, N, K, config", [
    (1, 96, 256, None),
    (5, 100, 300, (32, 128, 1)),  # N and K not multiples of the blocks
    (16, 64, 1024, (32, 64, 4)),
    (33, 50, 200, (16, 64, 2)),  # BLOCK_M 64 over 33 rows
    (3, 70, 1000, (32, 128, 8)),  # the last split's range is empty (8 x 128 > 1000)
    (MAX_ROWS, 128, 512, None),
])
def test_skinny_linear_is_the_rounded_product(M, N, K, config, dtype):
    x, w = operands(M, N, K, dtype)
    assert_rounded_product(skinny_linear(x, w, config), x, w)


def test_split_k_leaves_every_ticket_at_zero_for_the_next_launch():
    """A stripe's last program resets its counter: without that, the next launch's tickets would start past the
    last one and no program would write the output."""
    for seed in range(3):
        x, w = operands(4, 96, 512, torch.float32, seed)
        assert_rounded_product(skinny_linear(x, w, (32, 128, 4)), x, w)
        assert not gemm._counters[x.device].any()


def test_linear_takes_cublas_above_max_rows_and_rejects_what_it_cannot_multiply():
    x, w = operands(MAX_ROWS + 1, 32, 64, torch.float32)
    assert torch.equal(linear(x, w), F.linear(x, w))
    assert linear(x[:0], w).shape == (0, 32)
    assert_rounded_product(linear(x[:3], w), x[:3], w)
    for bad_x, bad_w in [(x, w), (x[:2], w[:, :60]), (x[:2, ::2], w[:, :32])]:
        with pytest.raises(ValueError, match="skinny_linear"):
            skinny_linear(bad_x, bad_w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N, K", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)])  # Qwen3-0.6B's
def test_model_projections_match_cublas_give_the_same_bits_every_time_and_replay_in_a_graph(N, K):
    for M in (1, 7, 16, 33, 64):
        x, w = operands(M, N, K, torch.bfloat16, seed=M)
        y = skinny_linear(x, w)
        ref = F.linear(x, w)
        ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(1e-3)
        assert ((y.float() - ref.float()).abs() <= 2 * ulp).all(), (M, N, K)  # cuBLAS sums in another order
        assert_rounded_product(y, x, w)
        for _ in range(20):
            assert torch.equal(skinny_linear(x, w), y)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = skinny_linear(x, w)
        for _ in range(3):
            out.zero_()
            graph.replay()
            assert torch.equal(out, y)
        assert not gemm._counters[x.device].any()
