"""Decode's projections: tandem's skinny Triton GEMM against cuBLAS (`F.linear`), against a copy's bandwidth, all
measured in the same run.

    python benchmarks/decode_gemm.py [--model qwen3-0.6b] [--rows 1 8 16 32 64] [--sweep]

For each of a layer's four projections (q/k/v fused, o, gate/up fused, down) and the LM head, in bf16: one CUDA
graph replays the product for every layer of the model, each with its own weight (so no call finds its weight
in L2, as in a decode step), and the time per call is the replay's over the layers. GB/s = weight bytes / time.
The correctness column is the largest difference from cuBLAS in units of the output's bf16 spacing at its
magnitude (both round fp32 sums once; they differ only in the sums' order). `--sweep` also times other
(BLOCK_N, BLOCK_K, SPLIT_K) choices and prints the best.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import sys

import torch
import torch.nn.functional as F

from tandem.config import resolve_model
from tandem.kernels.gemm import plan, skinny_linear

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from decode_attention_bench import copy_bandwidth, graph_seconds_per_call  # noqa: E402


def shapes(model: str) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, how many per step)."""
    c = resolve_model(model)[0]
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    L = c.num_hidden_layers
    return {"qkv": (q + 2 * kv, c.hidden_size, L), "o": (c.hidden_size, q, L),
            "gate_up": (2 * c.intermediate_size, c.hidden_size, L), "down": (c.hidden_size, c.intermediate_size, L),
            "lm_head": (c.vocab_size, c.hidden_size, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_gemm.py needs a GPU")
    torch.manual_seed(0)
    copy = copy_bandwidth()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"## decode GEMMs ({datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{args.model}); a device copy moves {copy / 1e9:.0f} GB/s\n")
    print("| projection | N x K | rows | cuBLAS us | tandem us (BLOCK_N, BLOCK_K, SPLIT_K) | speedup | "
          "cuBLAS GB/s | tandem GB/s | max diff (bf16 ulps) | best of sweep |")
    print("|---" * 10 + "|", flush=True)
    total = {}
    for name, (N, K, per_step) in shapes(args.model).items():
        layers = max(per_step, 8)
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        for M in args.rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref, mine = F.linear(x, ws[0]), skinny_linear(x, ws[0])
            ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(1e-3)
            diff = ((mine.float() - ref.float()).abs() / ulp).max().item()
            t_blas = graph_seconds_per_call([lambda w=w, x=x: F.linear(x, w) for w in ws])
            cfg = plan(M, N, K, num_sms)
            t_mine = graph_seconds_per_call([lambda w=w, x=x: skinny_linear(x, w) for w in ws])
            best = ""
            if args.sweep:
                timed = []
                for c in itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 4, 8)):
                    if K // c[2] >= c[1]:
                        with contextlib.suppress(Exception):  # (a choice may need more shared memory than there is)
                            timed.append((graph_seconds_per_call([lambda w=w, c=c, x=x: skinny_linear(x, w, c)
                                                                          for w in ws]),
                                          c))
                t, c = min(timed)
                best = f"{1e6 * t:.1f} us {c}"
            nbytes = N * K * 2
            for key, t in (("cuBLAS", t_blas), ("tandem", t_mine)):
                total[key, M] = total.get((key, M), 0.0) + per_step * t
            print(f"| {name} | {N} x {K} | {M} | {1e6 * t_blas:.1f} | {1e6 * t_mine:.1f} {cfg} | "
                  f"{t_blas / t_mine:.2f}x | {nbytes / t_blas / 1e9:.0f} | {nbytes / t_mine / 1e9:.0f} | {diff:.1f} | "
                  f"{best} |", flush=True)
    for M in args.rows:
        print(f"\none step's projections at {M} rows: cuBLAS {1e3 * total['cuBLAS', M]:.3f} ms, tandem "
              f"{1e3 * total['tandem', M]:.3f} ms ({total['cuBLAS', M] / total['tandem', M]:.2f}x)")


if __name__ == "__main__":
    main()
