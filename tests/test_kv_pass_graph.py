"""The decode's pass of a KV transfer by reference as a CUDA graph (`tandem.engine.kv_pass_graph`): the padded page
index (the pages first, the rest of no rows), the pass over it (under Triton's CPU interpreter here) giving the
eager pass's sums and pages while reading and writing nothing of the padding; on a GPU the replayed graphs equal
the eager pass bit for bit, across buckets and with a shorter transfer after a longer one, and a decode server
with `engine.kv_pass_graphs` generates what bytes give."""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so before the import

from test_kv_sums import sums_pool, write  # noqa: E402

from tandem.engine.kv_index_sums import canonical, kernel_pass, page_sums_by_index  # noqa: E402
from tandem.engine.kv_pass_graph import MIN_BUCKET, bucket_of, padded_index  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
P = 4


def test_the_padded_index_holds_the_pages_first_and_no_rows_after():
    index = np.full((3, 8), 9, dtype=np.int32)
    assert padded_index(index, [5, 2, 7], [1, 3, 4], 8, 18, P) == 3
    assert index.tolist() == [[5, 2, 7, 0, 0, 0, 0, 0], [1, 3, 4, 0, 0, 0, 0, 0], [4, 4, 2, 0, 0, 0, 0, 0]]
    padded_index(index, [6], [2], 0, 3, P)  # (fewer pages: what the longer one left is no row)
    assert index.tolist() == [[6] + [0] * 7, [2] + [0] * 7, [3] + [0] * 7]
    with pytest.raises(ValueError, match="do not hold positions"):
        padded_index(index, [1, 2], [3, 4], 0, 9, P)
    with pytest.raises(ValueError, match="more than 8"):
        padded_index(index, list(range(9)), list(range(9)), 0, 36, P)
    assert [bucket_of(n) for n in (0, 1, 16, 17, 33)] == [MIN_BUCKET, MIN_BUCKET, 16, 32, 64]


def pools(device: str):
    """A source pool with its records (slots 0-51 written) and a destination pool, 3 layers, bf16."""
    src, dst = sums_pool(3, 2, 8, torch.bfloat16, pages=16, page_size=P, device=device), \
        sums_pool(3, 2, 8, torch.bfloat16, pages=16, page_size=P, device=device)
    write(src, list(range(52)), torch.Generator().manual_seed(1))
    write(dst, list(range(64)), torch.Generator().manual_seed(2))
    return src, dst


def test_the_pass_over_a_padded_index_is_the_eager_pass_and_touches_no_padding():
    pytest.importorskip("triton")
    src, dst = pools(DEVICE)
    ref_dst = pools(DEVICE)[1]
    src_pages, dst_pages, n = [9, 3, 12, 5], [7, 11, 2, 14], 15  # (the last page short; page 0 is the padding's)
    want = page_sums_by_index(src.k_cache, src.v_cache, src_pages, 0, n, P, ref_dst.k_cache, ref_dst.v_cache,
                              dst_pages, records=src.sums)
    bucket = bucket_of(len(src_pages))
    index = torch.zeros((3, bucket), dtype=torch.int32)
    padded_index(index.numpy(), src_pages, dst_pages, 0, n, P)
    parts = torch.empty((bucket, 2, 3, 2), dtype=torch.int64, device=DEVICE)
    sums = torch.empty((2, bucket, 2), dtype=torch.int64, device=DEVICE)
    before = dst.k_cache.clone(), dst.v_cache.clone()
    kernel_pass((src.k_cache, src.v_cache), (dst.k_cache, dst.v_cache), src.sums, P, index.to(DEVICE), parts, sums)
    got = canonical(sums.cpu())
    assert torch.equal(got[:, :4], canonical(want.cpu())) and not got[:, 4:].any()  # (the padding sums to 0)
    assert torch.equal(dst.k_cache, ref_dst.k_cache) and torch.equal(dst.v_cache, ref_dst.v_cache)
    written = torch.zeros(dst.k_cache.shape[1], dtype=torch.bool)
    for i, page in enumerate(dst_pages):
        written[page * P:page * P + (P if i < 3 else n - 3 * P)] = True
    for cache, old in zip((dst.k_cache, dst.v_cache), before, strict=True):
        assert torch.equal(cache[:, ~written.to(cache.device)], old[:, ~written.to(cache.device)])  # (page 0 too)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_replayed_graphs_are_the_eager_pass_across_buckets():
    from tandem.engine.kv_pass_graph import PassGraphs

    src = sums_pool(3, 2, 64, torch.bfloat16, pages=200, page_size=P, device="cuda")
    write(src, list(range(200 * P)), torch.Generator().manual_seed(1))
    graphed, eager = (sums_pool(3, 2, 64, torch.bfloat16, pages=200, page_size=P, device="cuda") for _ in range(2))
    graphs = PassGraphs(src.k_cache, src.v_cache, src.sums, graphed.k_cache, graphed.v_cache, P)
    gen = torch.Generator().manual_seed(3)
    with torch.cuda.stream(torch.cuda.Stream()):  # (as the decode server's transfer stream)
        for num in (1, 15, 16, 17, 40, 3, 33):
            n = num * P - int(torch.randint(0, P, (1,), generator=gen))
            src_pages, dst_pages = (torch.randperm(200, generator=gen)[:num].tolist() for _ in range(2))
            want = page_sums_by_index(src.k_cache, src.v_cache, src_pages, 0, n, P, eager.k_cache, eager.v_cache,
                                      dst_pages, records=src.sums, read=True).result()
            got = graphs.run(src_pages, dst_pages, 0, n)
            assert np.array_equal(got, want), num
            assert torch.equal(graphed.k_cache, eager.k_cache) and torch.equal(graphed.v_cache, eager.v_cache), num
    assert sorted(graphs._graphs) == [16, 32, 64]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_decode_server_replaying_its_passes_generates_what_bytes_give(monkeypatch):
    from test_disagg_transfer import bytes_then_reference

    want, got, records = bytes_then_reference(monkeypatch, 2, kv_pass_graphs=True, kv_doorbells=False)
    assert got == [want, want] and all(r["landed"] for r in records), records
