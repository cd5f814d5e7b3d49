"""The fused MoE kernel's tile sizes (`tandem.kernels.moe.fused_experts`) at Qwen3-30B-A3B's expert shape: for each
decode batch size and candidate (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), microseconds per layer (a CUDA
graph's replay, as in the engine's decode step) and the bandwidth over the bytes of the experts the batch touched,
against a device-to-device copy in the same run.

    python benchmarks/moe_kernel_blocks.py [--batches 1 64 256] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
from engine_throughput import copy_bandwidth, seconds_per_call

from tandem.config import PRESETS
from tandem.kernels.moe import _blocks, fused_experts
from tandem.model.moe import route


def candidates(batch: int, top_k: int, num_experts: int):
    """The current choice first, then a small grid around it."""
    current = _blocks(batch * top_k, num_experts)
    grid = itertools.product([current[0]], [32, 64, 128], [64, 128, 256], [4, 8], [3, 4])
    return [current] + [c for c in grid if c != current]


def graphed(fn):
    """`fn` captured in a CUDA graph (as the engine's decode step runs it: no host launch overhead); its replay."""
    fn()  # (compiles the kernels outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args()
    config, device = PRESETS["qwen3-30b-a3b"], torch.device("cuda")
    E, H, inter, k = config.num_experts, config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    gen = torch.Generator(device=device).manual_seed(0)
    gate_up = torch.randn(E, 2 * inter, H, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    down = torch.randn(E, H, inter, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    bw = copy_bandwidth(2 << 30, "cuda")
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (read + write)")
    results = {"copy_bytes_per_s": bw, "batches": {}}
    for batch in args.batches:
        x = torch.randn(batch, H, device=device, dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(batch, E, device=device, dtype=torch.bfloat16, generator=gen)
        weights, ids = route(logits, k, True)
        touched = int(torch.unique(ids).numel())
        read = touched * 3 * H * inter * 2
        rows = []
        for blocks in candidates(batch, k, E):
            try:
                sec = seconds_per_call(graphed(functools.partial(fused_experts, x, gate_up, down, ids, weights,
                                                                 blocks)), args.iters, device)
            except Exception as e:  # noqa: BLE001 (a candidate the compiler refuses, e.g. out of shared memory)
                print(f"batch {batch} {blocks}: {type(e).__name__}")
                continue
            rows.append((sec, blocks))
        rows.sort()
        results["batches"][batch] = {"touched": touched, "bytes": read,
                                     "rows": [{"blocks": b, "us": s * 1e6, "bytes_per_s": read / s} for s, b in rows]}
        current = next(s for s, b in rows if b == candidates(batch, k, E)[0])
        print(f"\nbatch {batch}: {touched} experts touched, {read / 1e9:.2f} GB; current {current * 1e6:.0f} us "
              f"({read / current / bw:.0%} of copy BW)")
        print("| BLOCK_M, N, K, warps, stages | us / layer | GB/s | of copy BW |\n|---|---|---|---|")
        for sec, blocks in rows[:6]:
            print(f"| {blocks} | {sec * 1e6:.0f} | {read / sec / 1e9:,.0f} | {read / sec / bw:.0%} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
