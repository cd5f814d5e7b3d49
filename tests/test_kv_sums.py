"""Checksum records kept as the forward writes the KV (`KVPool(slot_sums=True)`, `tandem.kernels.kv_sums`): a page's
checksum from its slots' records is `kv_transfer.page_sums` of its bytes, whatever the order and chunking of the
writes and when a slot is written again; the Triton kernel's records are the torch path's bit for bit (under the
interpreter here, on the device in the `gpu` case); a prefill engine's exported pages have records that are their
bytes' (chunked prompts, prefix hits, a partially matched page copied), with nothing recorded at the pin, and pages
that came from the host tier are recorded as they are pinned (falsifier: without `mark_unsummed` their records are
of other bytes)."""

import asyncio
import dataclasses
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so before the import

from tandem.config import EngineConfig  # noqa: E402
from tandem.engine.engine import Engine  # noqa: E402
from tandem.engine.kv_index_sums import (  # noqa: E402
    _weights,
    _words_per_position,
    canonical,
    host_sums,
    page_sums_by_index,
    record_sums_by_index,
)
from tandem.engine.kv_pool import KVPool, records_page_sums  # noqa: E402
from tandem.engine.kv_transfer import page_sums  # noqa: E402
from tandem.types import SamplingParams  # noqa: E402

CASES = [  # layers, KV heads, head dim, dtype (a position's words: int32, int32 of fp32, int16 widened)
    (2, 2, 8, torch.bfloat16),
    (3, 1, 4, torch.float32),
    (2, 1, 3, torch.bfloat16),
]


def sums_pool(layers, heads, dim, dtype, pages=10, page_size=4, device="cpu") -> KVPool:
    config = SimpleNamespace(num_hidden_layers=layers, num_key_value_heads=heads, head_dim=dim, num_experts_per_tok=1)
    return KVPool(config, pages, page_size, dtype, device, slot_sums=True)


def write(pool: KVPool, slots: list[int], gen: torch.Generator) -> None:
    """Random keys and values at `slots` in every layer, each layer's records taken as a forward would."""
    index = torch.tensor(slots, device=pool.k_cache.device)
    for cache in (pool.k_cache, pool.v_cache):
        cache[:, index] = torch.randn(cache.shape[0], len(slots), *cache.shape[2:], generator=gen).to(cache)
    pool.record_sums(index)


@pytest.mark.parametrize("layers,heads,dim,dtype", CASES, ids=["bf16", "fp32", "bf16 int16 words"])
def test_a_pages_records_sum_to_its_checksum_however_it_was_written(layers, heads, dim, dtype):
    pool, gen, P = sums_pool(layers, heads, dim, dtype), torch.Generator().manual_seed(0), 4
    table, n = [7, 2, 5, 0], 14  # (the last page short)
    slots = [table[t // P] * P + t % P for t in range(n)]
    write(pool, slots[:5], gen)  # chunks that start and end inside pages
    write(pool, slots[5:11], gen)
    write(pool, slots[3:6] + slots[11:], gen)  # positions written again: their records replaced
    expected = page_sums(pool.k_cache[:, slots], pool.v_cache[:, slots], P)
    assert torch.equal(canonical(records_page_sums(pool.sums, table, 0, n, P)), expected)
    assert torch.equal(canonical(records_page_sums(pool.sums, table[2:], 8, n, P)), expected[2:])  # (a later page on)


def test_a_record_not_taken_leaves_the_checksum_wrong():
    """The falsifier of the records' completeness: a write whose records are not taken."""
    pool, gen, P = sums_pool(2, 2, 8, torch.bfloat16), torch.Generator().manual_seed(1), 4
    write(pool, list(range(8)), gen)
    pool.k_cache[1, 5] += 1  # (written, not recorded)
    assert not torch.equal(canonical(records_page_sums(pool.sums, [0, 1], 0, 8, P))[1],
                           page_sums(pool.k_cache[:, :8], pool.v_cache[:, :8], P)[1])


@pytest.mark.parametrize("layers,heads,dim,dtype", [c for c in CASES if c[2] * c[1] * c[3].itemsize % 4 == 0]
                         + [(1, 8, 128, torch.bfloat16)], ids=["bf16", "fp32", "qwen3-0.6b position"])
def test_the_kernels_records_are_the_torch_paths(layers, heads, dim, dtype):
    from tandem.kernels.kv_sums import record_slot_sums

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pool, gen = sums_pool(layers, heads, dim, dtype, device=device), torch.Generator().manual_seed(2)
    write(pool, [1, 9, 10, 30, 17, 3], gen)  # (the torch path's records)
    slots = torch.tensor([1, 9, 10, 30, 17, 3], dtype=torch.int32, device=device)
    out = torch.zeros_like(pool.sums)
    (row_k, col_k), (row_v, col_v) = _weights(layers, 4, _words_per_position(pool.k_cache), pool.k_cache.device)
    record_slot_sums(pool.k_cache, pool.v_cache, slots, out, (row_k, col_k, row_v, col_v), 4)
    # (the column part: the kernel keeps its 32 bits sign-extended, as torch's)
    assert torch.equal(out[slots.long()], pool.sums[slots.long()])
    assert not out[[0, 2]].any()  # nothing written elsewhere


def test_the_kernels_page_sums_of_records_are_the_torch_paths():
    from tandem.kernels import kv_sums

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pool = sums_pool(3, 2, 8, torch.bfloat16, pages=12, device=device)
    pool.sums.random_(-2**62, 2**62, generator=torch.Generator(device).manual_seed(4))  # (any records)
    pages, n = [9, 0, 4, 11], 14  # (the last page short)
    index = torch.tensor([pages, [4, 4, 4, 2]], dtype=torch.int32, device=device)
    got = kv_sums.page_sums(pool.sums, index[0], index[1], 4)
    assert torch.equal(canonical(got), canonical(records_page_sums(pool.sums, pages, 0, n, 4)))
    assert torch.equal(canonical(got[1:]), canonical(records_page_sums(pool.sums, pages[1:], 4, n, 4)))


def test_a_staged_index_is_its_columns():
    from tandem.engine.kv_index_sums import _stage_index

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for columns in (([5], [1]), ([3, 1, 4], np.array([1, 5, 9], dtype=np.int32), [2, 6, 5])):
        index, done = _stage_index(device, columns, None)
        assert index.tolist() == [list(map(int, c)) for c in columns]
        assert index.device.type == "cpu" and (device.type != "cuda" or index.is_pinned())  # (read in place)
        done()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_pool_records_through_the_kernel_what_the_cpu_records():
    cpu, gpu = (sums_pool(2, 8, 128, torch.bfloat16, device=d) for d in ("cpu", "cuda"))
    for pool in (cpu, gpu):
        write(pool, list(range(3, 40)), torch.Generator().manual_seed(3))
    assert torch.equal(cpu.sums, gpu.sums.cpu())


PREFILL = EngineConfig(page_size=4, num_pages=24, role="prefill", max_prefill_tokens=16)
ONE = SamplingParams(max_new_tokens=1, temperature=0.0)


def prompt(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def export_checked(p: Engine, ids: list[int]) -> np.ndarray:
    """Export `ids`' KV pinned; assert the checksums its records give are those of a pass over its pages; free it.
    The sums."""
    out = await p.generate(ids, ONE, export_kv_from=0, export_pinned=True)
    kv, pool, P = out.kv, p.pool, p.pool.page_size
    try:
        passed = host_sums(page_sums_by_index(pool.k_cache, pool.v_cache, kv.pages, kv.start, kv.end, P))
        recorded = host_sums(record_sums_by_index(pool.sums, kv.pages, kv.start, kv.end, P))
        assert np.array_equal(recorded, passed)
        return recorded
    finally:
        kv.free(True)


def test_a_prefill_engines_exports_take_the_records_checksums(monkeypatch):
    """Chunked prompts (16 tokens a step), a prefix hit, a partially matched page copied: every exported page's
    records are its bytes', and none had to be recorded as it was pinned (the forward recorded them)."""
    record_pages = KVPool.record_pages

    def nothing_stale(pool, pages):
        assert pool.summed[pages].all(), "a page was recorded at the pin"
        record_pages(pool, pages)

    async def go():
        with Engine("tiny", PREFILL) as p:
            assert p.pool.sums is not None
            a = prompt(37, 0)
            monkeypatch.setattr(KVPool, "record_pages", nothing_stale)
            first = await export_checked(p, a)
            again = await export_checked(p, a)  # (all but the last token from the cache, whose page is recomputed,
            assert np.array_equal(first[:-1], again[:-1])  # in another step shape: not always the same bytes)
            await export_checked(p, a[:30] + prompt(9, 1))  # (page 7 matched in part: copied, then written on)

    asyncio.run(go())


def exports_after_host_loads(monkeypatch, mark: bool) -> int:
    """A prefill engine whose pool holds 96 positions and whose host tier the rest: a prompt exported, the pool
    churned by others (its pages evicted to the host and reused), then the prompt again (its pages loaded from the
    host tier) and exported, each export's records checked against a pass. `mark`: False for a mutant pool that
    does not mark loaded pages (so they are not recorded as they are pinned). Returns the pages the tier loaded."""
    if not mark:
        monkeypatch.setattr(KVPool, "mark_unsummed", lambda self, pages: None)
    config = dataclasses.replace(PREFILL, host_cache="write_through", enable_prefix_cache=True)

    async def go():
        with Engine("tiny", config) as p:
            a = prompt(40, 0)
            await export_checked(p, a)
            for seed in range(1, 4):
                await export_checked(p, prompt(40, seed))
            await export_checked(p, a + prompt(4, 9))
            return p.core.tier.pages_loaded

    return asyncio.run(go())


def test_pages_loaded_from_the_host_tier_are_recorded_as_they_are_pinned(monkeypatch):
    assert exports_after_host_loads(monkeypatch, mark=True) > 0


def test_the_loaded_pages_falsifier_records_of_other_bytes_fail_the_export_check(monkeypatch):
    with pytest.raises(AssertionError):
        exports_after_host_loads(monkeypatch, mark=False)
