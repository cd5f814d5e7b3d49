"""The KV transfer's page checksums (`kv_transfer.page_sums`): the definition against a plain-Python reference, the
same value on every layout and device, and the changes a receiver must catch (falsifiers: a flipped word, swapped
pages, swapped positions each make `KVPages.verify` name a page)."""

import pytest
import torch

from tandem.engine.kv_transfer import MASK, KVPages, page_checksums, page_sums


def kv(layers=3, n=37, heads=2, dim=8, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(layers, n, heads, dim, generator=gen).to(dtype) for _ in range(2))


def odd(i: int, multiplier: int) -> int:
    return (i * multiplier) % (1 << 30) * 2 + 1


def wrap32(x: int) -> int:
    return (x + (1 << 31)) % (1 << 32) - (1 << 31)


def reference(k: torch.Tensor, v: torch.Tensor, page_size: int) -> list[str]:
    """The docstring's definition, one word at a time in Python integers."""
    layers, n = k.shape[:2]
    out = []
    for page in range(-(-n // page_size)):
        rows = cols = 0
        positions = range(page * page_size, min(n, (page + 1) * page_size))
        for which, x in enumerate((k, v)):
            per_position = x.contiguous().reshape(layers, n, -1)
            words = per_position.view(torch.int32 if per_position.shape[2] * x.element_size() % 4 == 0
                                      else torch.int16).tolist()
            num_words = len(words[0][0])
            for layer in range(layers):
                for t in positions:
                    offset = t - page * page_size
                    rows += wrap32(sum(words[layer][t])) * odd((which * layers + layer) * page_size + offset,
                                                              0x9E3779B1)
                for m in range(num_words):
                    column = wrap32(sum(words[layer][t][m] for t in positions))
                    cols += column * odd(which * (1 << 24) + layer * num_words + m, 0x85EBCA77)
        out.append(f"{rows & MASK:016x}{cols & 0xFFFFFFFF:08x}")
    return out


@pytest.mark.parametrize("dtype,heads,dim", [(torch.bfloat16, 2, 8), (torch.float32, 2, 4), (torch.bfloat16, 1, 3)],
                         ids=["bf16, int32 words", "fp32", "bf16, int16 words"])
def test_the_page_checksums_are_the_definitions_values(dtype, heads, dim):
    k, v = kv(layers=2, n=11, heads=heads, dim=dim, dtype=dtype)
    assert list(page_checksums(k, v, 4)) == reference(k, v, 4)


def test_the_checksums_do_not_depend_on_the_layout():
    """A non-contiguous view, and keys and values halves of one buffer, give the contiguous tensors' checksums."""
    k, v = kv()
    sums = page_checksums(k, v, 4)
    assert len(sums) == 10 and len(set(sums)) == 10
    wide = torch.zeros(3, 37, 2, 16, dtype=torch.bfloat16)
    wide[..., ::2] = k
    assert page_checksums(wide[..., ::2], v, 4) == sums
    both = torch.stack([k, v])
    assert page_checksums(both[0], both[1], 4) == sums
    assert page_checksums(k[:, :0], v[:, :0], 4) == ()


@pytest.mark.gpu
def test_a_gpu_gives_the_cpus_checksums():
    k, v = kv(layers=4, n=203, heads=4, dim=64)
    assert page_checksums(k.cuda(), v.cuda(), 16) == page_checksums(k, v, 16)
    assert torch.equal(page_sums(k.cuda(), v.cuda(), 16).cpu(), page_sums(k, v, 16))


def arrived(k, v, sent: KVPages) -> str:
    """What `verify` says of `k`, `v` arriving for what `sent` announced ("" if they verify)."""
    try:
        KVPages(sent.start, k, v, sent.page_size, sent.checksums).verify()
    except ValueError as e:
        return str(e)
    return ""


def test_a_flipped_bit_anywhere_is_named_by_its_page_and_only_it():
    k, v = kv()
    sent = KVPages(0, k, v, 4, page_checksums(k, v, 4))
    assert arrived(k.clone(), v.clone(), sent) == ""
    for x, layer, pos, head, d, bit in [(0, 0, 0, 0, 0, 0), (1, 2, 36, 1, 7, 15), (1, 1, 17, 0, 3, 14),
                                        (0, 2, 8, 1, 0, 7)]:
        changed = [k.clone(), v.clone()]
        changed[x].view(torch.int16)[layer, pos, head, d] ^= 1 << bit
        after = page_checksums(*changed, 4)
        assert [i for i in range(10) if after[i] != sent.checksums[i]] == [pos // 4]
        assert f"page {pos // 4} (positions {pos // 4 * 4}...)" in arrived(*changed, sent)


def test_swapped_pages_and_swapped_positions_are_named():
    k, v = kv()
    sent = KVPages(0, k, v, 4, page_checksums(k, v, 4))
    order = list(range(37))
    order[4:8], order[12:16] = order[12:16], order[4:8]  # pages 1 and 3 swapped
    assert "page 1 (positions 4...)" in arrived(k[:, order], v[:, order], sent)
    order = list(range(37))
    order[21], order[22] = 22, 21  # two positions of page 5
    assert "page 5 (positions 20...)" in arrived(k[:, order], v[:, order], sent)
    assert "page 0 (positions 0...)" in arrived(v, k, sent)  # keys for values
    layers = [1, 0, 2]
    assert "page 0 (positions 0...)" in arrived(k[layers], v[layers], sent)  # layers swapped
    assert "9 pages arrived, the sender sent 10" in arrived(k[:, :36], v[:, :36], sent)
