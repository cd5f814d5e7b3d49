"""The Triton paged decode kernel's achieved bandwidth against a device-to-device copy, measured in the same run.

    python benchmarks/decode_attention_bench.py [--context 1024] [--batch 1 64 256] [--page-size 16 32] [--sweep]
    python benchmarks/decode_attention_bench.py --mixed 100 2048 --table-tokens 40960 --splits 1 2 4 8 16

Qwen3-0.6B's attention shape (16 query heads, 8 kv heads, head dim 128, bf16 cache), pages scattered over the
pool. Each timed call reads its own block table's pages (several calls per captured CUDA graph, rotating
through at least `--rotate-mib` of KV), so the time is the kernel's, with no launch overhead and no KV left
in L2 by the previous call, as in a real decode step where every layer reads another cache.
Bandwidth = KV bytes read / time; the copy's bandwidth counts bytes read plus bytes written. `eager us` is
`triton.testing.do_bench` of one launch from Python (launch overhead included). `--sweep` adds rows for other
split counts and block sizes; `--splits` times those split counts; `--tiles` other block sizes, warps and pipeline
stages. `--mixed LOW HIGH`: each request's context uniform in [LOW, HIGH] (seeded) instead of `--context`, as in a
serving batch; `--table-tokens N`: block tables N tokens wide (the engine's CUDA graphs use the model's longest
context, which sets the automatic split count).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from typing import NamedTuple

import torch
import triton

from tandem.kernels.decode_attention import choose_num_kv_splits, paged_decode_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE = 16, 8, 128, torch.bfloat16


def graph_seconds_per_call(calls, replays: int = 10, trials: int = 5) -> float:
    """Capture all `calls` in one CUDA graph; the best trial's replay time divided by the number of calls."""
    for call in calls:
        call()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    best = float("inf")
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / (replays * len(calls)))
    return best


def copy_bandwidth(num_bytes: int = 1 << 30) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    return 2 * num_bytes / graph_seconds_per_call([lambda: dst.copy_(src)])


class Setup:
    """A pool with `num_tables` disjoint batches of `batch` requests of the contexts `lens`, pages shuffled, block
    tables `width` pages wide (past a request's pages: page 0, never read)."""

    def __init__(self, lens: list[int], page_size: int, rotate_bytes: int, width: int | None = None):
        batch = len(lens)
        self.page_size = page_size
        self.kv_bytes = 2 * sum(lens) * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
        self.num_tables = triton.cdiv(rotate_bytes, self.kv_bytes)
        pages_per_req = triton.cdiv(max(lens), page_size)
        num_pages = self.num_tables * batch * pages_per_req
        shape = (num_pages * page_size, NUM_KV_HEADS, HEAD_DIM)
        self.k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
        self.v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
        pages = torch.randperm(num_pages, device="cuda").int().view(self.num_tables, batch, pages_per_req)
        width = max(width or 0, pages_per_req)
        self.tables = torch.zeros(self.num_tables, batch, width, dtype=torch.int32, device="cuda")
        self.tables[:, :, :pages_per_req] = pages
        self.q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")

    def call(self, table: int, config: Config):
        splits, block_n, warps, stages = config
        return lambda: paged_decode_attention(self.q, self.k_cache, self.v_cache, self.tables[table], self.seq_lens,
                                              self.page_size, HEAD_DIM ** -0.5, splits, block_n, num_warps=warps,
                                              num_stages=stages)


class Config(NamedTuple):
    """One launch configuration: None = the kernel's default."""

    splits: int | None = None
    block_n: int | None = None
    warps: int = 4
    stages: int = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--page-size", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--rotate-mib", type=int, default=512, help="KV read per graph replay (defeats L2)")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--splits", type=int, nargs="+", default=[], help="also time these split counts")
    parser.add_argument("--mixed", type=int, nargs=2, metavar=("LOW", "HIGH"), help="contexts uniform in [LOW, HIGH]")
    parser.add_argument("--table-tokens", type=int, help="block tables this many tokens wide")
    parser.add_argument("--tiles", action="store_true", help="also time other block_n / warps / stages")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")

    copy_bw = copy_bandwidth()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"## paged decode attention ({datetime.date.today()}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, triton {triton.__version__})")
    print(f"command: python {' '.join(sys.argv)}\n")
    contexts = f"contexts uniform in {args.mixed}" if args.mixed else f"context {args.context}"
    tables = args.table_tokens or "as wide as the longest context's"
    print(f"H={NUM_HEADS} K={NUM_KV_HEADS} D={HEAD_DIM} bf16, {contexts}, tables {tables} tokens; "
          f"device-to-device copy: {copy_bw / 1e12:.2f} TB/s (read + write)\n")
    print("| page | batch | splits | block_n | warps | stages | KV MiB | graph us | eager us | KV TB/s | of copy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for page_size in args.page_size:
        for batch in args.batch:
            gen = torch.Generator().manual_seed(batch)
            lens = (torch.randint(args.mixed[0], args.mixed[1] + 1, (batch,), generator=gen).tolist() if args.mixed
                    else [args.context] * batch)
            width = triton.cdiv(args.table_tokens, page_size) if args.table_tokens else None
            setup = Setup(lens, page_size, args.rotate_mib << 20, width)
            auto = choose_num_kv_splits(batch, NUM_KV_HEADS, setup.tables.shape[2] * page_size, num_sms)
            configs = [Config()] + [Config(splits) for splits in args.splits if splits != auto]
            if args.sweep:
                configs += [Config(splits) for splits in sorted({1, 4, 16, 64} - {auto})]
                configs += [Config(block_n=block_n) for block_n in (16, 64)]
            if args.tiles:
                configs += [Config(block_n=n, warps=w, stages=st) for n in (32, 64) for w in (4, 8)
                            for st in (2, 3, 4) if (n, w, st) != (32, 4, 2)]
            for config in configs:
                seconds = graph_seconds_per_call([setup.call(t, config) for t in range(setup.num_tables)])
                eager_ms = triton.testing.do_bench(setup.call(0, config))
                bw = setup.kv_bytes / seconds
                splits = f"{config.splits}" if config.splits else f"{auto} (auto)"
                print(f"| {page_size} | {batch} | {splits} | {config.block_n or 'default'} | {config.warps} | "
                      f"{config.stages} | {setup.kv_bytes / 2**20:.0f} | "
                      f"{seconds * 1e6:.1f} | {eager_ms * 1e3:.1f} | {bw / 1e12:.2f} | {bw / copy_bw:.0%} |")
            del setup
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
