"""The one-pass KV transfer's checksums and copy (`tandem.kernels.kv_copy`, `kv_index_sums.page_sums_by_index`): the
Triton kernel against `kv_transfer.page_sums` over the same positions gathered by torch, bit for bit (under Triton's
CPU interpreter here, on the device in the `gpu` cases), the pages it writes equal to those it read and nothing
else written; the torch path (a CPU's) against the same definition; falsifiers: a changed word or a page read from
elsewhere changes the page's checksum."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so before the import

from tandem.engine import kv_index_sums  # noqa: E402
from tandem.engine.kv_index_sums import _weights, _words_per_position, canonical, page_sums_by_index  # noqa: E402
from tandem.engine.kv_transfer import page_sums  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pool(layers, pages, page_size, heads, dim, dtype, seed=0, device="cpu"):
    """Random keys and values [L, (pages + 1) * page_size, K, D] (random bits, NaNs and all, for a bf16 pool)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (layers, (pages + 1) * page_size, heads, dim)
    words = torch.randint(-2**31, 2**31 - 1, (2, *shape[:-1], dim * dtype.itemsize // 4), generator=gen,
                          dtype=torch.int32) if dtype.itemsize * dim % 4 == 0 else None
    kv = words.view(dtype) if words is not None else torch.randn((2, *shape), generator=gen).to(dtype)
    return kv[0].contiguous().to(device), kv[1].contiguous().to(device)


def reference(k, v, pages, start, end, page_size):
    """`page_sums` of the positions gathered by slot."""
    pos = torch.arange(end - start)
    slots = (torch.tensor(pages)[pos // page_size] * page_size + pos % page_size).to(k.device)
    return page_sums(k.index_select(1, slots).cpu(), v.index_select(1, slots).cpu(), page_size), slots


CASES = [  # layers, pool pages, page size, KV heads, head dim, dtype, positions
    (3, 12, 4, 2, 6, torch.float32, 18),
    (2, 10, 4, 1, 8, torch.bfloat16, 16),
    (2, 9, 16, 2, 64, torch.bfloat16, 37),
    (1, 6, 8, 3, 10, torch.float16, 9),
    (1, 5, 16, 8, 128, torch.bfloat16, 40),  # (qwen3-0.6b's position: 512 words, two chunks of the row a program)
    (2, 7, 6, 1, 8, torch.float32, 20),  # (pages of 6 positions: rows masked to a power of 2)
]


def kernel_sums(k, v, pages, start, end, page_size, dst=None, dst_pages=None):
    from tandem.kernels.kv_copy import copy_page_sums

    num = len(pages)
    rows = [page_size] * num
    rows[-1] = end - start - (num - 1) * page_size
    index = torch.tensor([pages, dst_pages or pages, rows], dtype=torch.int32, device=k.device)
    parts = []
    for which, (src, out) in enumerate(zip((k, v), dst or (None, None), strict=True)):
        row_w, col_w = _weights(k.shape[0], page_size, _words_per_position(k), k.device)[which]
        parts.append(copy_page_sums(src, index[0], index[2], page_size, row_w, col_w, out,
                                    index[1] if out is not None else None))
    return canonical(torch.cat(parts, dim=1).sum(1).cpu())


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"L{c[0]} P{c[2]} K{c[3]} D{c[4]} {c[5]} n{c[6]}")
def test_the_kernel_gives_the_definitions_checksums_and_copies_only_the_pages_named(case):
    pytest.importorskip("triton")
    layers, num_pages, P, heads, dim, dtype, n = case
    k, v = pool(layers, num_pages, P, heads, dim, dtype, device=DEVICE)
    num = -(-n // P)
    src_pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1))[:num].tolist()
    dst_pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(2))[:num].tolist()
    want, src_slots = reference(k, v, src_pages, 0, n, P)
    dk, dv = pool(layers, num_pages, P, heads, dim, dtype, seed=7, device=DEVICE)
    before_k, before_v = dk.clone(), dv.clone()
    assert torch.equal(kernel_sums(k, v, src_pages, 0, n, P), want.cpu())
    got = kernel_sums(k, v, src_pages, 0, n, P, (dk, dv), dst_pages)
    assert torch.equal(got, want.cpu())
    _, dst_slots = reference(dk, dv, dst_pages, 0, n, P)
    for src, dst, before in ((k, dk, before_k), (v, dv, before_v)):
        assert torch.equal(dst[:, dst_slots].view(torch.uint8), src[:, src_slots].view(torch.uint8))
        untouched = torch.ones(dst.shape[1], dtype=torch.bool, device=dst.device)
        untouched[dst_slots] = False
        assert torch.equal(dst[:, untouched].view(torch.uint8), before[:, untouched].view(torch.uint8))


@pytest.mark.parametrize("case", CASES[:2], ids=["fp32", "bf16"])
def test_a_changed_word_or_another_page_changes_that_pages_checksum(case):
    pytest.importorskip("triton")
    layers, num_pages, P, heads, dim, dtype, n = case
    k, v = pool(layers, num_pages, P, heads, dim, dtype, device=DEVICE)
    pages = [3, 1, 7, 5, 2][:-(-n // P)]
    want = kernel_sums(k, v, pages, 0, n, P)
    k.view(torch.uint8)[1, 1 * P + 2, 0, 1] ^= 4  # (page 1 of the pool: the transfer's page 1)
    changed = kernel_sums(k, v, pages, 0, n, P)
    assert [i for i in range(len(pages)) if not torch.equal(changed[i], want[i])] == [1]
    swapped = kernel_sums(k, v, [pages[0], pages[2], pages[1], *pages[3:]], 0, n, P)
    assert not torch.equal(swapped[1], changed[1]) and not torch.equal(swapped[2], changed[2])


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[5]} n{c[6]}")
def test_the_dispatch_gives_the_definitions_checksums_and_copies(case, kernel, monkeypatch):
    """`page_sums_by_index`: on a CPU it gathers, sums and scatters with torch; made to take the kernel (under the
    interpreter here), keys and values into one buffer of parts: the same values (`canonical`) and pages."""
    if kernel:
        pytest.importorskip("triton")
        if torch.cuda.is_available():  # (CPU tensors take the kernel under the interpreter only, off a GPU machine)
            pytest.skip("the kernel on the device: test_on_the_gpu_the_kernel_path_gives_the_cpus_checksums...")
        monkeypatch.setattr(kv_index_sums, "_kernel_ok", lambda *caches: True)
    layers, num_pages, P, heads, dim, dtype, n = case
    k, v = pool(layers, num_pages, P, heads, dim, dtype)
    num = -(-n // P)
    src_pages, dst_pages = list(range(num_pages - num, num_pages)), list(range(num))
    want, src_slots = reference(k, v, src_pages, 0, n, P)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    assert torch.equal(canonical(page_sums_by_index(k, v, src_pages, 0, n, P, dk, dv, dst_pages)), want)
    _, dst_slots = reference(dk, dv, dst_pages, 0, n, P)
    assert torch.equal(dk[:, dst_slots].view(torch.uint8), k[:, src_slots].view(torch.uint8))
    with pytest.raises(ValueError, match="do not hold positions"):
        page_sums_by_index(k, v, src_pages[:-1], 0, n, P)


@pytest.mark.gpu
def test_on_the_gpu_the_kernel_path_gives_the_cpus_checksums_at_the_models_shape():
    """qwen3-0.6b's layout (28 layers, 8 KV heads of 128, bf16, pages of 16), 1,000 positions: the dispatch takes
    the kernel on the GPU and gives what the CPU's torch path gives, pages and all."""
    k, v = pool(28, 80, 16, 8, 128, torch.bfloat16)
    pages = torch.randperm(80, generator=torch.Generator().manual_seed(3))[:63].tolist()
    dst_pages = list(range(63))
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    want = page_sums_by_index(k, v, pages, 0, 1000, 16, dk, dv, dst_pages)
    gk, gv = k.cuda(), v.cuda()
    gdk, gdv = torch.zeros_like(gk), torch.zeros_like(gv)
    got = page_sums_by_index(gk, gv, pages, 0, 1000, 16, gdk, gdv, dst_pages)
    assert torch.equal(canonical(got.cpu()), want)
    assert torch.equal(gdk.cpu().view(torch.uint8), dk.view(torch.uint8))
    assert torch.equal(gdv.cpu().view(torch.uint8), dv.view(torch.uint8))
    records = torch.randint(-2**62, 2**62, (81 * 16, 28, 2), generator=torch.Generator().manual_seed(4))
    want_both = page_sums_by_index(k, v, pages, 0, 1000, 16, dk, dv, dst_pages, records=records)
    got_both = page_sums_by_index(gk, gv, pages, 0, 1000, 16, gdk, gdv, dst_pages, records=records.cuda())
    assert torch.equal(canonical(got_both.cpu()), canonical(want_both)) and torch.equal(canonical(want_both[0]), want)


TILES = ["Tile(16, 1)", "Tile(1024, 2)", "Tile(16384, 16, stream=True)", "Tile(16, 1, defer=True)",
         "Tile(1024, 4, defer=True)", "Tile(8192, 8, stream=True, defer=True)", "COPY_TILE", "SUMS_TILE"]


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("case", [CASES[4], CASES[5]], ids=["qwen3-position", "pages-of-6"])
def test_every_tile_gives_the_same_checksums_and_pages(case, tile, monkeypatch):
    """`kv_copy.Tile` changes only how a program walks its page: sums and pages as the definition's, whatever the
    chunk of a row (down to a row in many chunks, up to a page in one), the warps, the streaming hints or the
    reductions deferred to the end."""
    pytest.importorskip("triton")
    from tandem.kernels.kv_copy import COPY_TILE, SUMS_TILE, Tile  # noqa: F401 (eval'd below)

    monkeypatch.setattr(kv_index_sums, "_kernel_ok", lambda *caches: True)
    layers, num_pages, P, heads, dim, dtype, n = case
    k, v = pool(layers, num_pages, P, heads, dim, dtype, device=DEVICE)
    num = -(-n // P)
    src_pages, dst_pages = list(range(num_pages - num, num_pages)), list(range(num))
    want, src_slots = reference(k, v, src_pages, 0, n, P)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    got = page_sums_by_index(k, v, src_pages, 0, n, P, dk, dv, dst_pages, tile=eval(tile))
    assert torch.equal(canonical(got.cpu()), want.cpu())
    assert torch.equal(canonical(page_sums_by_index(k, v, src_pages, 0, n, P, tile=eval(tile)).cpu()), want.cpu())
    _, dst_slots = reference(dk, dv, dst_pages, 0, n, P)
    assert torch.equal(dk[:, dst_slots].view(torch.uint8), k[:, src_slots].view(torch.uint8))
    assert torch.equal(dv[:, dst_slots].view(torch.uint8), v[:, src_slots].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["Tile(1024, 2)", "Tile(4096, 4)", "Tile(8192, 8, stream=True)",
                                  "Tile(16384, 16, stream=True)", "Tile(4096, 4, defer=True)",
                                  "Tile(8192, 8, stream=True, defer=True)", "COPY_TILE", "SUMS_TILE"])
def test_on_the_gpu_every_tile_gives_the_cpus_checksums_at_the_models_shape(tile):
    """qwen3-0.6b's layout, 1,000 positions, the sweep's corners and the defaults: the same sums and pages as the
    CPU's torch path."""
    from tandem.kernels.kv_copy import COPY_TILE, SUMS_TILE, Tile  # noqa: F401 (eval'd below)

    k, v = pool(28, 80, 16, 8, 128, torch.bfloat16)
    pages = torch.randperm(80, generator=torch.Generator().manual_seed(4))[:63].tolist()
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    want = page_sums_by_index(k, v, pages, 0, 1000, 16, dk, dv, list(range(63)))
    gk, gv = k.cuda(), v.cuda()
    gdk, gdv = torch.zeros_like(gk), torch.zeros_like(gv)
    got = page_sums_by_index(gk, gv, pages, 0, 1000, 16, gdk, gdv, list(range(63)), tile=eval(tile))
    assert torch.equal(canonical(got.cpu()), want)
    assert torch.equal(canonical(page_sums_by_index(gk, gv, pages, 0, 1000, 16, tile=eval(tile)).cpu()), want)
    assert torch.equal(gdk.cpu().view(torch.uint8), dk.view(torch.uint8))
    assert torch.equal(gdv.cpu().view(torch.uint8), dv.view(torch.uint8))


def test_a_tile_that_no_program_can_hold_is_refused():
    pytest.importorskip("triton")
    from tandem.kernels.kv_copy import Tile

    for words, warps in ((1000, 4), (8, 4), (4096, 3)):
        with pytest.raises(ValueError, match="Tile: words must be a power of 2"):
            Tile(words, warps)


SM90_CHECK = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from tandem.kernels import kv_copy

jit = kv_copy._copy_page_sums_kernel
names = jit.arg_names
pointers = {"src_ptr": "*i32", "dst_ptr": "*i32", "src_pages_ptr": "*i32", "dst_pages_ptr": "*i32",
            "rows_ptr": "*i32", "row_w_ptr": "*i64", "col_w_ptr": "*i64", "out_ptr": "*i64"}
signature = {name: pointers.get(name, "i32") for name in names[:11]} | dict.fromkeys(names[11:], "constexpr")
found = {}
for name, write, tile in (("fused", True, kv_copy.COPY_TILE), ("sums", False, kv_copy.SUMS_TILE),
                          ("fused, deferred", True, kv_copy.Tile(4096, 4, defer=True))):
    constexprs = {"words": 512, "page_size": 16, "WRITE": write, "BLOCK_P": 16,
                  "BLOCK_M": max(16, min(512, tile.words // 16)), "EVICT": "evict_first" if tile.stream else "",
                  "STORE_CACHE": ".cs" if tile.stream else "", "DEFER": tile.defer}
    try:
        source = triton.compiler.ASTSource(fn=jit, signature=signature, constexprs=constexprs,
                                           attrs={(i,): [["tt.divisibility", 16]] for i in range(11)})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": tile.num_warps})
    except Exception as e:
        print(json.dumps({"skip": f"{type(e).__name__}: {e}"[:300]}))
        sys.exit(0)
    found[name] = sorted(set(re.findall(r"(?:ld|st)\\.global[\\w.]*\\.v4\\.b32", compiled.asm["ptx"])))
print(json.dumps(found))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU's check of the code a GPU would run")
def test_the_kernel_compiles_for_sm90_with_128_bit_accesses():
    """The kernel as the JIT specialises it for qwen3-0.6b's layout (pointers and strides divisible by 16), with
    the default tiles, compiles for an H100/H200 (sm_90) and reads (and, fused, writes) the KV in 128-bit accesses:
    the copy's own width. (In a process of its own: this one runs Triton's interpreter.)"""
    pytest.importorskip("triton")
    from sm90 import run_compile_check

    found = run_compile_check(SM90_CHECK, timeout=120)
    for name in ("fused", "sums", "fused, deferred"):
        assert any(a.startswith("ld") for a in found[name]), found
        assert name == "sums" or any(a.startswith("st") for a in found[name]), found
