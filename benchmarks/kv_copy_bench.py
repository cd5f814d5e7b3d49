"""The one-pass KV transfer's kernel alone (`tandem.kernels.kv_copy` through `kv_mapped.page_sums_by_index`),
device time, against a plain copy of the same bytes: what the KV transfer by reference costs on the device, so that
`disaggregation.py --transfer-only` can tell it from the host's part.

    python benchmarks/kv_copy_bench.py [--model qwen3-0.6b] [--tokens 8192] [--out kv_copy.json]

Two pools of the model's KV layout (bf16, pages of 16) holding `tokens` positions, the source's pages scattered;
timed with CUDA events, median of `reps` after a warm-up: (1) the fused pass (read the source pages, write the
destination pages, checksums of what it read; `page_sums_by_index` with a destination: both launches, keys and
values, and the sums over layers), (2) the checksum pass alone (what a prefill server's export costs), (3)
`torch` copy of the same bytes, contiguous (the reference: `copy_time(B)`), (4) a torch gather by index of the same
pages (what the previous transfer did, three times). Each row: ms, and the copy's time over it (100% = as fast as
the plain copy of the same bytes).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from tandem.config import PRESETS


def _time(fn, reps: int) -> float:
    """Median device seconds of `fn` (CUDA events around each call, after two warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def kernel_times(model: str = "qwen3-0.6b", tokens: int = 8192, page_size: int = 16, reps: int = 20,
                 device: str = "cuda") -> dict:
    """The four device times above, in seconds, with the KV bytes moved; pools freed before it returns."""
    from tandem.engine.kv_mapped import _kernel_ok, page_sums_by_index

    cfg = PRESETS[model]
    layers, heads, dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    pages = -(-tokens // page_size)
    shape = (layers, (2 * pages + 1) * page_size, heads, dim)
    t = {name: torch.randn(shape, device=device).to(torch.bfloat16) for name in ("src_k", "src_v")}
    t["dst_k"], t["dst_v"] = torch.zeros_like(t["src_k"]), torch.zeros_like(t["src_v"])
    gen = torch.Generator().manual_seed(0)
    src_pages = torch.randperm(2 * pages, generator=gen)[:pages].tolist()
    dst_pages = torch.randperm(2 * pages, generator=gen)[:pages].tolist()
    kv_bytes = 2 * layers * tokens * heads * dim * 2
    t["flat_src"] = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
    t["flat_dst"] = torch.empty_like(t["flat_src"])
    pos = torch.arange(tokens)
    slots = (torch.tensor(src_pages)[pos // page_size] * page_size + pos % page_size).to(device)
    out = {"model": model, "tokens": tokens, "kv_bytes": kv_bytes, "kernel": _kernel_ok(t["src_k"], t["dst_k"]),
           "fused_s": _time(lambda: page_sums_by_index(t["src_k"], t["src_v"], src_pages, 0, tokens, page_size,
                                                       t["dst_k"], t["dst_v"], dst_pages), reps),
           "sums_s": _time(lambda: page_sums_by_index(t["src_k"], t["src_v"], src_pages, 0, tokens, page_size),
                           reps),
           "copy_s": _time(lambda: t["flat_dst"].copy_(t["flat_src"]), reps),
           "gather_s": _time(lambda: (t["src_k"].index_select(1, slots), t["src_v"].index_select(1, slots)), reps)}
    t.clear()
    torch.cuda.empty_cache()
    return out


def report(times: dict) -> None:
    copy = times["copy_s"]
    print(f"\n| the transfer's kernel alone ({times['tokens']} tokens, {times['kv_bytes'] / 1e6:,.1f} MB of KV, "
          f"device time; Triton: {'yes' if times['kernel'] else 'NO (torch path)'}) | ms | copy time / time |")
    print("|---|---|---|")
    for what, key in (("fused: read the pages, write them, checksums (decode server's write)", "fused_s"),
                      ("checksums alone (prefill server's export)", "sums_s"),
                      ("torch copy of the same bytes, contiguous (the reference)", "copy_s"),
                      ("torch gather by index of the same pages (keys and values)", "gather_s")):
        print(f"| {what} | {1e3 * times[key]:.3f} | {copy / times[key]:.0%} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out")
    args = p.parse_args()
    times = kernel_times(args.model, args.tokens)
    report(times)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(times, f, indent=1)


if __name__ == "__main__":
    main()
