"""Whole pages moved by index between a paged pool and page-major stores (`tandem.kernels.page_move`): the kernel
against torch's indexed copies, bit for bit, both directions, keys, values and routing, odd page counts, index
regions at any offset (under Triton's CPU interpreter here; in the `gpu` cases between the device and a real
pinned host buffer, the index read from pinned memory); nothing but the pages named is written. The index ring
never rewrites a region before the launch that reads it has run."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so before the import

from tandem.kernels.page_move import IndexRing, move_pages, paged_store, pool_store  # noqa: E402

CASES = [  # layers, pool pages, page size, KV heads, head dim, dtype, routing (layers, k) or None
    (2, 9, 4, 2, 6, torch.float32, (3, 2)),
    (3, 7, 16, 2, 64, torch.bfloat16, None),
    (1, 5, 6, 3, 10, torch.float16, (2, 1)),  # (a chunk of 180 elements: masked blocks)
    (2, 6, 16, 8, 128, torch.bfloat16, (28, 8)),  # (qwen3-0.6b's page of a layer: 16,384 elements, 4 blocks)
]


def random_pool(layers, pages, P, heads, dim, dtype, routing, seed, device="cpu"):
    """Keys, values [L, (pages + 1) * P, K, D] of random bits (NaN patterns too) and routing [S, layers, k]."""
    gen = torch.Generator().manual_seed(seed)
    shape = (layers, (pages + 1) * P, heads, dim)
    bits = torch.randint(-2**15, 2**15, (2, *shape[:-1], dim * dtype.itemsize // 2), generator=gen,
                         dtype=torch.int16)
    kv = bits.view(dtype)
    r = None if routing is None else torch.randint(-1, 64, (shape[1], *routing), generator=gen, dtype=torch.int16)
    move = (lambda t: None if t is None else t.to(device))
    return move(kv[0].contiguous()), move(kv[1].contiguous()), move(r)


def random_pages(n, layers, P, heads, dim, dtype, routing, seed, pin=False):
    """Page-major KV [n, 2, L, P, K, D] and routing [n, P, layers, k] of random bits."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**15, 2**15, (n, 2, layers, P, heads, dim * dtype.itemsize // 2), generator=gen,
                         dtype=torch.int16)
    kv = bits.view(dtype).contiguous()
    r = None if routing is None else torch.randint(-1, 64, (n, P, *routing), generator=gen, dtype=torch.int16)
    if pin:
        kv, r = kv.pin_memory(), None if r is None else r.pin_memory()
    return kv, r


def by_page(k, v, r, P):
    """The pool by page: k, v [pages, L, P, K, D] (views), routing [pages, P, layers, k]."""
    L, _, K, D = k.shape
    return (k.view(L, -1, P, K, D).transpose(0, 1), v.view(L, -1, P, K, D).transpose(0, 1),
            None if r is None else r.view(-1, P, *r.shape[1:]))


def same(a, b):
    return a is None and b is None or torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def index_at(values, offset, device="cpu", pin=False):
    """An int32 buffer holding `values` from `offset` on, junk around them."""
    buf = torch.full((offset + len(values) + 3,), 10_000, dtype=torch.int32)
    buf[offset:offset + len(values)] = torch.tensor(values, dtype=torch.int32)
    return buf.pin_memory() if pin else buf.to(device)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"L{c[0]} P{c[2]} K{c[3]} D{c[4]} {c[5]} r{c[6]}")
@pytest.mark.parametrize("num", [1, 3])
def test_pool_pages_to_page_major_pages_and_back_are_torchs_indexed_copies(case, num):
    layers, pool_pages, P, heads, dim, dtype, routing = case
    k, v, r = random_pool(layers, pool_pages, P, heads, dim, dtype, routing, seed=1)
    host, hr = random_pages(7, layers, P, heads, dim, dtype, routing, seed=2)
    src = torch.randperm(pool_pages, generator=torch.Generator().manual_seed(3))[:num].tolist()
    dst = torch.randperm(7, generator=torch.Generator().manual_seed(4))[:num].tolist()
    want, want_r = host.clone(), None if hr is None else hr.clone()
    kp, vp, rp = by_page(k, v, r, P)
    want[dst, 0], want[dst, 1] = kp[src], vp[src]
    if hr is not None:
        want_r[dst] = rp[src]
    # (odd offsets: the index regions of a ring are anywhere in it)
    move_pages(pool_store(k, v, r, P), paged_store(host, hr), index_at(src + dst, 5), num, src_at=5)
    assert same(host, want) and same(hr, want_r)

    k2, v2, r2 = random_pool(layers, pool_pages, P, heads, dim, dtype, routing, seed=5)
    want_k, want_v, want_r = k2.clone(), v2.clone(), None if r2 is None else r2.clone()
    wk, wv, wr = by_page(want_k, want_v, want_r, P)
    back = torch.randperm(pool_pages, generator=torch.Generator().manual_seed(6))[:num].tolist()
    wk[back], wv[back] = host[dst, 0], host[dst, 1]
    if wr is not None:
        wr[back] = hr[dst]
    move_pages(paged_store(host, hr), pool_store(k2, v2, r2, P), index_at(back + dst, 2), num, src_at=2 + num,
               dst_at=2)
    assert same(k2, want_k) and same(v2, want_v) and same(r2, want_r)


def test_stores_of_different_pages_and_a_short_index_are_refused():
    k, v, r = random_pool(2, 4, 4, 2, 6, torch.float32, (3, 2), seed=0)
    host, hr = random_pages(3, 2, 4, 2, 6, torch.float32, (3, 2), seed=0)
    other, _ = random_pages(3, 2, 4, 2, 8, torch.float32, None, seed=0)
    with pytest.raises(ValueError, match="different pages"):
        move_pages(pool_store(k, v, r, 4), paged_store(other), index_at([0, 1], 0), 1)
    with pytest.raises(ValueError, match="does not hold pages"):
        move_pages(pool_store(k, v, r, 4), paged_store(host, hr), index_at([0, 1], 0), 2, src_at=3)
    with pytest.raises(ValueError, match="contiguous"):
        paged_store(host[:, :, :1])


class FakeEvent:
    def __init__(self, done=True):
        self.done, self.waited = done, False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = self.done = True


@pytest.mark.parametrize("mutant", [False, True])
def test_the_ring_rewrites_a_region_only_after_the_launch_reading_it_has_run(monkeypatch, mutant):
    if mutant:
        monkeypatch.setattr(IndexRing, "_reclaim", lambda self, start, end: None)
    ring = IndexRing(10, pinned=False, guarded=True)
    first = FakeEvent(done=False)
    assert ring.put([1, 2, 3, 4]) == 0
    ring.seal(first)
    assert ring.put([5, 6, 7]) == 4
    ring.seal(FakeEvent())
    assert ring.put([8, 9, 10, 11]) == 0  # (no room at the end: round to the start, over the first region)
    assert first.waited != mutant  # the first launch had not run: the put waited for it
    assert ring.buffer[:7].tolist() == [8, 9, 10, 11, 5, 6, 7]
    if not mutant:
        with pytest.raises(AssertionError, match="before its launch was sealed"):
            ring.put([0] * 9)  # (the last region is not sealed yet)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES[1:], ids=["bf16", "fp16", "qwen3-0.6b"])
def test_gpu_device_pages_to_pinned_host_pages_and_back_bit_for_bit(case):
    """Zero-copy: the kernel stores into and loads from page-locked host memory, the index read there too."""
    layers, pool_pages, P, heads, dim, dtype, routing = case
    k, v, r = random_pool(layers, pool_pages, P, heads, dim, dtype, routing, seed=1, device="cuda")
    host, hr = random_pages(9, layers, P, heads, dim, dtype, routing, seed=2, pin=True)
    want, want_r = host.clone(), None if hr is None else hr.clone()
    src, dst = [pool_pages - 1, 0, 2], [8, 3, 4]
    kp, vp, rp = by_page(k, v, r, P)
    want[dst, 0], want[dst, 1] = kp[src].cpu(), vp[src].cpu()
    if hr is not None:
        want_r[dst] = rp[src].cpu()
    move_pages(pool_store(k, v, r, P), paged_store(host, hr), index_at(src + dst, 1, pin=True), 3, src_at=1)
    torch.cuda.synchronize()
    assert same(host, want) and same(hr, want_r)
    k2, v2, r2 = (torch.zeros_like(t) if t is not None else None for t in (k, v, r))
    move_pages(paged_store(host, hr), pool_store(k2, v2, r2, P), index_at(dst + src, 0, pin=True), 3)
    torch.cuda.synchronize()
    k2p, v2p, r2p = by_page(k2, v2, r2, P)
    assert same(k2p[src], kp[src]) and same(v2p[src], vp[src]) and (r is None or same(r2p[src], rp[src]))
    untouched = [p for p in range(pool_pages + 1) if p not in src]
    assert not k2p[untouched].view(torch.int16).any() and not v2p[untouched].view(torch.int16).any()


@pytest.mark.gpu
def test_gpu_pageable_host_memory_is_refused():
    k, v, r = random_pool(2, 4, 4, 2, 8, torch.bfloat16, None, seed=0, device="cuda")
    host, _ = random_pages(3, 2, 4, 2, 8, torch.bfloat16, None, seed=0)
    with pytest.raises(ValueError, match="pageable"):
        move_pages(pool_store(k, v, r, 4), paged_store(host), index_at([0, 1], 0, pin=True), 1)
    with pytest.raises(ValueError, match="pageable"):
        move_pages(pool_store(k, v, r, 4), paged_store(host.pin_memory()), index_at([0, 1], 0), 1)
