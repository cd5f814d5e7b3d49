"""Kernels whose arguments change from step to step compile once, not once per value (GPU only).

Triton compiles a variant of a kernel per signature, which by default includes whether each integer argument is 1
or divisible by 16 and whether each pointer is 16-byte aligned. The engine launches some kernels outside its CUDA
graphs with arguments that change every step (the sampler's batch and its split count, the prefill kernel's
block-table width and tile count, the KV transfer's page index: three rows of one staged tensor, 16-byte aligned or
not with the page count): each of those is declared varying (`tandem.kernels.fused.varying`), so a value first seen
mid-run compiles nothing while every request waits. Each test launches a kernel once, then with the varying
arguments at other values (1, a multiple of 16, neither; views that start 8 bytes into their storage) and asserts
that no new variant was compiled. Without the declarations each fails.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from tandem.engine.kv_index_sums import page_sums_by_index  # noqa: E402
from tandem.kernels import kv_copy, prefill_attention, sampling  # noqa: E402


def variants(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def unaligned(values: torch.Tensor) -> torch.Tensor:
    """The same values in a view that starts one element into its storage."""
    out = torch.empty(values.numel() + 1, dtype=values.dtype, device=values.device)[1:]
    return out.copy_(values)


def test_sampler_compiles_once_for_any_batch():
    V = 65536  # (its split counts can be 1, 16 or neither)

    def launch(B, splits, aligned):
        temps = torch.rand(B, device="cuda")
        seeds, positions = torch.arange(B, device="cuda"), torch.arange(B, device="cuda") + 5
        if not aligned:
            temps, seeds, positions = unaligned(temps), unaligned(seeds), unaligned(positions)
        sampling.sample_gumbel(torch.randn(B, V, device="cuda"), temps, seeds, positions, num_splits=splits)
        return variants(sampling._split_kernel), variants(sampling._merge_kernel)

    first = launch(3, 3, aligned=False)
    later = [launch(B, splits, aligned) for B in (1, 16, 17) for splits in (1, 16, None) for aligned in (True, False)]
    assert all(c == first for c in later), (first, later)


def test_prefill_compiles_once_for_any_width_and_tile_count():
    K, G, D, P = 2, 2, 128, 16
    k, v = (torch.randn(64 * P, K, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    block_m = prefill_attention.choose_blocks(G, D, k.dtype)[0]
    ints = dict(dtype=torch.int32, device="cuda")

    def launch(width, num_tiles):
        """One sequence of width * P - 3 tokens over `width` pages (and an empty padding one): untiled, and
        tiled over `num_tiles` tiles."""
        n = width * P - 3
        q = torch.randn(n, K * G, D, device="cuda", dtype=torch.bfloat16)
        table = torch.arange(2 * width, **ints).view(2, width)
        args = (q, k, v, table, torch.tensor([0, n, n], **ints), torch.tensor([n, 0], **ints), P, 0.1, n)
        prefill_attention.paged_prefill_attention(*args)
        num_tiles = max(num_tiles, -(-n // block_m))
        tiles = prefill_attention.fill_tiles([n], block_m, num_tiles, pad_seq=1).cuda()
        prefill_attention.paged_prefill_attention(*args, tiles_2N=tiles)
        return variants(prefill_attention._prefill_kernel)

    first = launch(3, 3)
    later = [launch(width, num_tiles) for width in (1, 16, 17) for num_tiles in (1, 16, 33)]
    assert all(c == first for c in later), (first, later)


def test_kv_transfer_compiles_once_for_any_page_count():
    """The transfer's page index is one staged [3, pages] tensor whose rows start 4 * pages bytes apart."""
    L, P, K, D = 2, 16, 2, 64
    src_k, src_v, dst_k, dst_v = (torch.randn(L, 64 * P, K, D, device="cuda", dtype=torch.bfloat16)
                                  for _ in range(4))

    def launch(pages):
        n = pages * P - 5
        page_sums_by_index(src_k, src_v, list(range(pages)), 0, n, P)
        page_sums_by_index(src_k, src_v, list(range(pages)), 0, n, P, dst_k, dst_v, list(range(8, 8 + pages)))
        return variants(kv_copy._copy_page_sums_kernel)

    first = launch(3)
    later = [launch(pages) for pages in (1, 2, 4, 5, 6, 16, 17)]
    assert all(c == first for c in later), (first, later)
