"""Random paged KV caches for the kernel tests: each sequence's pages scattered over the pool, page 0 never
used (padded block-table entries point there) and every slot nobody may read holding NaN, so an out-of-range
read shows up in the output."""

import torch

NUM_LAYERS, LAYER = 2, 1  # the kernels get a layer's view of a [L, S, K, D] cache, as the engine passes it


def scattered_cache(kv_lens, num_kv_heads, head_dim, page_size, gen):
    """(k_cache, v_cache [L, S, K, D] float32, block_table [B, width] int32) holding random KV for the first
    `kv_lens[b]` positions of sequence b."""
    pages_per_seq = [-(-n // page_size) for n in kv_lens]
    width = max(pages_per_seq) + 1  # one extra column of padding for every row
    num_pages = 1 + sum(pages_per_seq) + 3
    shape = (NUM_LAYERS, num_pages * page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    order = (1 + torch.randperm(num_pages - 1, generator=gen)).tolist()
    block_table = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    for b, (n, num_seq_pages) in enumerate(zip(kv_lens, pages_per_seq, strict=True)):
        pages = torch.tensor([order.pop() for _ in range(num_seq_pages)], dtype=torch.long)
        block_table[b, :num_seq_pages] = pages.int()
        pos = torch.arange(n)
        slots = pages[pos // page_size] * page_size + pos % page_size
        k_cache[:, slots] = torch.randn(NUM_LAYERS, n, num_kv_heads, head_dim, generator=gen)
        v_cache[:, slots] = torch.randn(NUM_LAYERS, n, num_kv_heads, head_dim, generator=gen)
    return k_cache, v_cache, block_table
