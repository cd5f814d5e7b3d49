"""The Triton paged decode kernel against a plain PyTorch reference (gather by block table, fp32 softmax).

Without CUDA the kernel runs under Triton's CPU interpreter, so those cases stay tiny; the `gpu` cases run
the larger shapes (long contexts with many splits, batch 17, every page size) and a CUDA-graph replay.
Every slot no request may read (page 0, which padded block-table entries point to, and the tail of each
request's last page) holds NaN, so a read past a request's end shows up as NaN in the output.
"""

import os

import pytest
import torch
from paged_cases import LAYER, scattered_cache

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so before the import
pytest.importorskip("triton")

from tandem.kernels.decode_attention import choose_num_kv_splits, paged_decode_attention  # noqa: E402
from tandem.kernels.fused import qk_norm_rope  # noqa: E402
from tandem.model.attention import Fresh, PagedAttention, paged_decode_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS, THETA = 1e-6, 1_000_000.0
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_case(seq_lens, num_kv_heads, group, head_dim, page_size, dtype, seed=0, device=DEVICE):
    """Random q and caches; each request's pages are scattered over the pool, page 0 is never used."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_table = scattered_cache(seq_lens, num_kv_heads, head_dim, page_size, gen)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(device) for t in (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), block_table, seq_lens)]


def reference(q_BHD, k_cache_SKD, v_cache_SKD, block_table_BP, seq_lens_B, page_size, scale):
    B, H, D = q_BHD.shape
    group = H // k_cache_SKD.shape[1]
    out = torch.zeros(B, H, D, dtype=torch.float32)
    for b in range(B):
        n = int(seq_lens_B[b])
        if n == 0:
            continue
        pos = torch.arange(n, device=q_BHD.device)
        slots = block_table_BP[b, pos // page_size].long() * page_size + pos % page_size
        k_LHD = k_cache_SKD[slots].float().repeat_interleave(group, dim=1)
        v_LHD = v_cache_SKD[slots].float().repeat_interleave(group, dim=1)
        probs_HL = torch.einsum("hd,lhd->hl", q_BHD[b].float(), k_LHD).mul(scale).softmax(-1)
        out[b] = torch.einsum("hl,lhd->hd", probs_HL, v_LHD).cpu()
    return out


def check(seq_lens, num_kv_heads, group, head_dim, page_size, dtype, num_kv_splits=None, seed=0):
    q, k_cache, v_cache, block_table, lens = make_case(seq_lens, num_kv_heads, group, head_dim, page_size, dtype,
                                                       seed)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, k_cache[LAYER], v_cache[LAYER], block_table, lens, page_size, scale,
                                 num_kv_splits=num_kv_splits)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    want = reference(q, k_cache[LAYER], v_cache[LAYER], block_table, lens, page_size, scale)
    torch.testing.assert_close(out.float().cpu(), want, **TOLERANCE[dtype])


# (seq_lens, num_kv_heads, group, head_dim, page_size, dtype, num_kv_splits): small enough for the interpreter
SMALL_CASES = [
    ([1], 2, 1, 64, 16, torch.float32, None),
    ([15, 16, 37], 2, 4, 128, 16, torch.float32, 3),  # tail of a page, a full page, several splits
    ([3], 1, 4, 64, 16, torch.float32, 8),  # most splits empty
    ([15, 0, 33], 2, 2, 64, 16, torch.float32, 1),  # one split (and a padding row)
    ([0, 31, 70], 1, 4, 64, 32, torch.bfloat16, 2),  # a padding row, bf16
    ([40, 0, 63], 2, 1, 128, 64, torch.bfloat16, None),
    ([1, 5, 0, 9, 16, 2, 33, 7, 12, 0, 4, 20, 17, 3, 8, 30, 11], 1, 4, 64, 16, torch.float32, 2),  # batch 17
]


@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: f"lens{len(c[0])}-K{c[1]}-G{c[2]}-D{c[3]}-P{c[4]}")
def test_matches_reference_small(case):
    check(*case)


class _NanScratch:
    """`torch` for decode_attention's module, but its `empty` scratch starts as NaN (what unwritten memory may
    hold)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, **kwargs):
        return torch.full(shape, float("nan"), **kwargs)


def spy_on_split_lse(monkeypatch) -> list[torch.Tensor]:
    """Give decode_attention's module `_NanScratch` and return the list its [B, H, N] scratch tensors (the splits'
    log-sum-exps) are appended to, one per call."""
    from tandem.kernels import decode_attention

    found = []

    class Spy(_NanScratch):
        @staticmethod
        def empty(*shape, **kwargs):
            out = _NanScratch.empty(*shape, **kwargs)
            if len(shape) == 3:
                found.append(out)
            return out

    monkeypatch.setattr(decode_attention, "torch", Spy())
    return found


def test_the_merge_reads_no_output_an_empty_split_did_not_write(monkeypatch):
    """A split past its request's end writes only its log-sum-exp (-inf): the merge must neither weigh nor read
    that split's output, which is never written (NaN here)."""
    from tandem.kernels import decode_attention

    monkeypatch.setattr(decode_attention, "torch", _NanScratch())
    check([3, 0, 40], 2, 2, 64, 16, torch.float32, num_kv_splits=8)  # most splits empty, a padding row


@pytest.mark.parametrize("cap, splits", [(512, [6, 1, 1, 1, 0]), (128, [8, 1, 1, 1, 0])])
def test_splits_follow_the_batchs_context_tokens(monkeypatch, cap, splits):
    """With the default split count (8 here), a split holds at least the batch's context tokens over
    BALANCED_PROGRAMS_PER_SM programs an SM, at most MAX_BALANCED_SPLIT: 1,240 tokens over 4 x 4 / 2 kv heads = 8
    programs a kv head makes splits of at least 155 tokens, whole blocks of 64: 192, so 1,000 positions take 6
    splits and the short contexts one each, where cutting each context into 8 would make 8, 2, 2, 1 splits; capped
    at 128 tokens, the long context takes all 8. Counted from the splits that wrote a log-sum-exp (the others,
    -inf, wrote nothing, and the output still matches the reference)."""
    from tandem.kernels import decode_attention

    found = spy_on_split_lse(monkeypatch)
    monkeypatch.setattr(decode_attention, "_num_sms", lambda device: 4)
    monkeypatch.setattr(decode_attention, "MAX_BALANCED_SPLIT", cap)
    check([1000, 100, 100, 40, 0], 2, 2, 64, 16, torch.float32)
    (lse,) = found
    assert lse.shape[2] == 8
    assert (lse[:, 0] > float("-inf")).sum(1).tolist() == splits


def test_the_balance_counts_every_request_of_a_large_batch(monkeypatch):
    """The batch's context tokens are summed `LENS_BLOCK` requests at a time (4 here, 256 on a GPU): the fifth
    request's 512 tokens count too (a total of 516 over 4 programs: splits of at least 129 tokens, whole blocks of
    64, so 192, and 3 of them for that request; if only the first 4 requests counted, 8 splits of 64)."""
    from tandem.kernels import decode_attention

    found = spy_on_split_lse(monkeypatch)
    monkeypatch.setattr(decode_attention, "PROGRAMS_PER_SM", 1024)  # (as many splits as the context allows: 8)
    monkeypatch.setattr(decode_attention, "LENS_BLOCK", 4)
    check([1] * 4 + [512], 1, 1, 64, 16, torch.float32)
    lse = found[0]
    assert lse.shape[2] == 8
    assert (lse[-1, 0] > float("-inf")).sum().item() == 3


@pytest.mark.parametrize("cap, items", [(512, 10), (64, 16)])
def test_programs_that_loop_over_items_compute_every_split(monkeypatch, cap, items):
    """Where most of the first stage's (request, split) programs would have nothing to do, it launches one a work
    item (`first_stage_programs`: 8 + 5 here, not 5 x 8) and each computes its items in turn. Splits of at least
    1,440 / 8 tokens (192 in whole blocks) make 10 items (6 + 1 + 1 + 2), one a program at most; with the cap at
    64 tokens, 16 (8 + 2 + 1 + 5), so three programs compute two each. Every split is written once (the scratch
    starts as NaN), and the output matches the reference."""
    from tandem.kernels import decode_attention

    launched = []

    def spy(*args):
        launched.append(decode_attention_programs(*args))
        return launched[-1]

    decode_attention_programs = decode_attention.first_stage_programs
    found = spy_on_split_lse(monkeypatch)
    monkeypatch.setattr(decode_attention, "first_stage_programs", spy)
    monkeypatch.setattr(decode_attention, "_num_sms", lambda device: 4)
    monkeypatch.setattr(decode_attention, "LOOP_SAVES", 1)
    monkeypatch.setattr(decode_attention, "MAX_BALANCED_SPLIT", cap)
    check([1000, 100, 0, 40, 300], 2, 2, 64, 16, torch.float32)
    assert launched == [(13, True)]
    assert (found[0][:, 0] > float("-inf")).sum().item() == items


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_any_even_head_dim_matches_reference(head_dim):
    """Head dims that are not powers of two run in a padded block whose extra lanes are masked: a lane read past
    the head would read the next head's keys or a NaN slot."""
    check([5, 17], 2, 2, head_dim, 16, torch.float32, num_kv_splits=2)


def test_matches_engine_paged_attention():
    """The engine's PyTorch context writes each request's new K/V, then attends; the kernel, given the cache it
    wrote, agrees (the contract of a GPU `attend`: write the new slots, then call the kernel)."""
    lens, num_kv_heads, head_dim, page_size = [1, 17, 40], 2, 64, 16
    q, k_cache, v_cache, block_table, seq_lens = make_case(lens, num_kv_heads, 2, head_dim, page_size, torch.float32)
    k_cache.nan_to_num_(0.0), v_cache.nan_to_num_(0.0)  # the PyTorch context's padded gather reads slot 0
    kv_slots = [block_table[b, torch.arange(n, device=DEVICE) // page_size].long() * page_size
                + torch.arange(n, device=DEVICE) % page_size for b, n in enumerate(lens)]
    ctx = PagedAttention(k_cache, v_cache, torch.stack([s[-1] for s in kv_slots]), q_lens=[1] * len(lens),
                         kv_lens=lens, kv_slots=kv_slots)
    new_k, new_v = (torch.randn(len(lens), num_kv_heads, head_dim, device=DEVICE) for _ in range(2))
    want = ctx.attend(LAYER, q, new_k, new_v)
    out = paged_decode_attention(q, k_cache[LAYER], v_cache[LAYER], block_table, seq_lens, page_size,
                                 head_dim ** -0.5)
    torch.testing.assert_close(out, want, **TOLERANCE[torch.float32])


def test_matches_paged_decode_reference():
    """The PyTorch kernel behind the same seam gives the same numbers, padding rows included."""
    page_size = 16
    case = make_case([0, 9, 33], 2, 4, 64, page_size, torch.float32)
    q, k_cache, v_cache, block_table, seq_lens = case
    k_cache.nan_to_num_(0.0), v_cache.nan_to_num_(0.0)  # the reference gathers whole block-table rows
    args = (q, k_cache[LAYER], v_cache[LAYER], block_table, seq_lens, page_size, 0.1)
    torch.testing.assert_close(paged_decode_attention(*args), paged_decode_reference(*args),
                               **TOLERANCE[torch.float32])


def check_fresh(seq_lens, num_kv_heads, group, head_dim, page_size, dtype, num_kv_splits=None):
    """`fresh=`: q/k norm, RoPE and the new keys' and values' write inside the kernel, against the chain it
    replaces (`qk_norm_rope` writing the caches, then the kernel). The newest slots hold NaN before (stale: the
    kernel must use what it computes); padding rows (seq_len 0) write nothing, other slots are left alone."""
    q_raw, k_cache, v_cache, block_table, lens = make_case(seq_lens, num_kv_heads, group, head_dim, page_size, dtype)
    B, K, D = len(seq_lens), num_kv_heads, head_dim
    gen = torch.Generator().manual_seed(7)
    k_raw, v_raw = (torch.randn(B, K, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    q_norm, k_norm = ((1 + 0.2 * torch.randn(D, generator=gen)).to(DEVICE, dtype) for _ in range(2))
    positions = torch.randint(0, 4000, (B,), generator=gen).to(DEVICE)
    valid = [b for b, n in enumerate(seq_lens) if n > 0]
    slots = torch.zeros(B, dtype=torch.int64, device=DEVICE)  # (padding rows: slot 0, a page no request reads)
    for b in valid:
        n = seq_lens[b] - 1
        slots[b] = int(block_table[b, n // page_size]) * page_size + n % page_size
    k_cache, v_cache = k_cache[LAYER].clone(), v_cache[LAYER].clone()
    k_cache[slots[valid]] = v_cache[slots[valid]] = float("nan")
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q, _ = qk_norm_rope(q_raw, k_raw, q_norm, k_norm, positions, THETA, EPS, kv_cache=(v_raw, want_k, want_v, slots))
    scale = head_dim ** -0.5
    want = paged_decode_attention(q, want_k, want_v, block_table, lens, page_size, scale, num_kv_splits)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out = paged_decode_attention(q_raw, k_cache, v_cache, block_table, lens, page_size, scale, num_kv_splits,
                                 fresh=Fresh(k_raw, v_raw, q_norm, k_norm, positions, slots, THETA, EPS))
    torch.testing.assert_close(out, want, **TOLERANCE[dtype])
    written = slots[valid]
    for got, ref, before in ((k_cache, want_k, before_k), (v_cache, want_v, before_v)):
        torch.testing.assert_close(got[written], ref[written], **TOLERANCE[dtype])
        got[written] = before[written]
        torch.testing.assert_close(got, before, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("case", [
    ([1, 20, 0], 2, 2, 64, 16, torch.float32, None),
    ([17, 33], 1, 4, 128, 16, torch.float32, 3),  # the newest position in a split's later block
    ([0, 31, 70], 2, 2, 64, 32, torch.bfloat16, 2),
], ids=["fp32", "fp32-splits3", "bf16"])
def test_fresh_matches_the_chain_it_replaces(case):
    check_fresh(*case)


def test_num_kv_splits_heuristic():
    for batch_size in (1, 3, 17, 64, 256):
        for max_len in (16, 1024, 32768):
            splits = choose_num_kv_splits(batch_size, 8, max_len, num_sms=132)
            assert splits & (splits - 1) == 0 and 1 <= splits <= 64
            assert splits == 1 or max_len / splits >= 64
    assert choose_num_kv_splits(1, 8, 32768, 132) == 32  # one long request: two programs an SM, through splits
    assert choose_num_kv_splits(5, 8, 32768, 132) == 64  # above a few requests, many programs an SM
    assert choose_num_kv_splits(256, 8, 32768, 132) == 2  # a large batch nearly fills it by itself
    assert choose_num_kv_splits(64, 8, 32768, 132) == 8


GPU_CASES = [
    ([1000], 8, 2, 128, 16, torch.bfloat16),
    ([1, 15, 1000], 2, 4, 128, 16, torch.float32),
    ([16, 999, 0], 4, 1, 64, 32, torch.bfloat16),
    ([31, 1, 1024], 2, 4, 64, 32, torch.float32),
    ([int(n) for n in torch.randint(0, 1100, (17,), generator=torch.Generator().manual_seed(1))], 8, 2, 128, 16,
     torch.bfloat16),
    ([63, 64, 1000], 1, 8, 128, 64, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_splits", [None, 1, 7, 64])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"B{len(c[0])}-K{c[1]}-G{c[2]}-D{c[3]}-P{c[4]}-{c[5]}")
def test_matches_reference_gpu(case, num_kv_splits):
    check(*case, num_kv_splits=num_kv_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("seq_lens", [[1024] * 8, [30000] + [2000] * 7], ids=["uniform", "one long"])
def test_the_looping_first_stage_matches_the_reference_gpu(monkeypatch, seq_lens):
    """Eight requests as the engine's graphs launch them (a block table as wide as the longest context, 40,960
    positions: 64 splits a context) take the first stage whose programs loop over work items (`first_stage_programs`),
    on this GPU's own multiprocessors; with one long context the balance's cap binds and programs compute
    several items each. The output matches the reference."""
    from tandem.kernels import decode_attention

    launched = []
    programs = decode_attention.first_stage_programs
    monkeypatch.setattr(decode_attention, "first_stage_programs", lambda *a: launched.append(programs(*a)) or
                        launched[-1])
    q, k_cache, v_cache, table, lens = make_case(seq_lens, 8, 2, 128, 16, torch.bfloat16)
    table = torch.nn.functional.pad(table, (0, 40960 // 16 - table.shape[1]))  # (page 0: never read)
    out = paged_decode_attention(q, k_cache[LAYER], v_cache[LAYER], table, lens, 16, 128 ** -0.5)
    want = reference(q, k_cache[LAYER], v_cache[LAYER], table, lens, 16, 128 ** -0.5)
    assert [loop for _, loop in launched] == [True], launched
    torch.testing.assert_close(out.float().cpu(), want, **TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_splits", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fresh_matches_the_chain_gpu(dtype, num_kv_splits):
    check_fresh([1, 1000, 0, 4097], 8, 2, 128, 16, dtype, num_kv_splits)


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_lengths_and_pages():
    """Captured once, replayed for two different batches written into the same q, block-table and length buffers
    (rows 0-3 of one pool, then rows 4-7): the graph must follow the lengths and pages, not what it saw."""
    page_size, scale = 16, 128 ** -0.5
    all_q, k_cache, v_cache, all_table, all_lens = make_case([5, 1000, 0, 300, 700, 0, 1, 64], 8, 2, 128, page_size,
                                                             torch.bfloat16)
    q, block_table, lens = all_q[:4].clone(), all_table[:4].clone(), all_lens[:4].clone()

    def run():
        return paged_decode_attention(q, k_cache[LAYER], v_cache[LAYER], block_table, lens, page_size, scale)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for rows in (slice(0, 4), slice(4, 8)):
        q.copy_(all_q[rows])
        block_table.copy_(all_table[rows])
        lens.copy_(all_lens[rows])
        graph.replay()
        want = reference(q, k_cache[LAYER], v_cache[LAYER], block_table, lens, page_size, scale)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float().cpu(), want, **TOLERANCE[torch.bfloat16])
