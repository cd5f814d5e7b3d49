"""The few-row projections (`tandem.kernels.small_linear`) on a GPU: tilings and programmatic dependent launch.

    python benchmarks/small_linear_blocks.py [--model qwen3-0.6b] [--rows 1 4 16] [--out blocks.json]

For each projection of a dense layer at the model's shape (q/k/v with the input norm, o with the residual add,
gate/up with the norm and SiLU, down with the residual add), a CUDA graph of as many of them back to back as the
model has layers (each with weights of its own, so that they come from memory, not L2) is timed per tiling, and
the best kept. Then one graph of the whole
chain, layer after layer, is timed with the best tilings against the chain the model runs without these kernels
(cuBLAS matrix multiplies beside the fused norm, residual and SiLU kernels), attention left out of both. Bytes:
the weights a chain reads, against a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json

import torch
import torch.nn.functional as F
from engine_throughput import copy_bandwidth, seconds_per_call

from tandem.config import PRESETS
from tandem.kernels import fused
from tandem.kernels.small_linear import (
    Blocks,
    arrival_counts,
    default_blocks,
    small_linear,
    small_qkv,
    vector_blocks,
)

EPS = 1e-6


def graph_seconds(fn, iters: int = 20) -> float:
    fn()  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return seconds_per_call(graph.replay, iters)


def projections(cfg, T: int):
    """name -> (weight, input, norm weight or None, residual or None, silu, heads or None); q/k/v as the model
    runs it (`small_qkv`: q/k norm, RoPE and the KV written in its epilogue)."""
    E, H, K, D, inter = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.intermediate_size)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * shape[-1] ** -0.5

    norm = torch.ones(E, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(T, device="cuda")
    caches = tuple(torch.zeros(T, K, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    heads = (norm[:D], norm[:D], slots, H, (*caches, slots))  # q/k norms, positions, heads, KV destination
    return {"qkv": (rand((H + 2 * K) * D, E), rand(T, E), norm, None, False, heads),
            "o": (rand(E, H * D), rand(T, H * D), None, rand(T, E), False, None),
            "gate_up": (rand(2 * inter, E), rand(T, E), norm, None, True, None),
            "down": (rand(E, inter), rand(T, inter), None, rand(T, E), False, None)}


ARRIVED = {}


def run_small(proj, blocks: Blocks | None):
    w, x, norm, residual, silu, heads = proj
    arrived = ARRIVED.setdefault("counts", arrival_counts("cuda"))
    if heads is not None:
        q_norm, k_norm, positions, H, dest = heads
        return lambda: small_qkv(x, w, norm, EPS, q_norm, k_norm, positions, 1e6, H, dest, arrived, blocks)
    return lambda: small_linear(x, w, norm, EPS, out=residual, silu=silu, blocks=blocks, arrived=arrived)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--out")
    args = parser.parse_args()
    cfg = PRESETS[args.model]
    L = cfg.num_hidden_layers
    bw = copy_bandwidth()
    print(f"## few-row projections ({datetime.date.today()}, {torch.cuda.get_device_name()}, {args.model}, {L} "
          f"layers; copy {bw / 1e12:.2f} TB/s)\n")
    # (narrow tiles and 8 warps too: fewer registers and less shared memory a program, kernel_resources.py)
    tilings = [Blocks(n, k, warps, 3, True, splits) for n, k, warps, splits in itertools.product(
        (16, 32), (64, 128, 256), (4, 8), (1, 2, 4, 8))]
    results = {"model": args.model, "copy_bytes_per_s": bw, "rows": {}}
    for T in args.rows:
        layers = [projections(cfg, T) for _ in range(L)]
        projs = layers[0]
        best, rows = {}, []
        for name, proj in projs.items():
            N, E = proj[0].shape[0] // (2 if proj[4] else 1), proj[0].shape[1]
            heads = proj[0].shape[0] // cfg.head_dim if proj[5] else None
            default = default_blocks(N, E, proj[0].device, heads=heads, rows=T, paired=proj[4])
            print(f"  {name} T={T}: default {default}")
            # (vector tiles only up to 4 rows: each row count compiles them anew; the default stops at VECTOR_ROWS)
            vector = [dataclasses.replace(vector_blocks(N, E, proj[0].device, heads=heads, tile_bytes=b,
                                                        paired=proj[4]), warps=w)
                      for b, w in itertools.product((4096, 8192, 16384, 32768), (2, 4, 8)) if T <= 4]
            narrow = [b for b in tilings if not heads or b.n == 16]  # (a program holds a head: n is not used)
            timed = []
            for blocks in [default, dataclasses.replace(default, pdl=False), *narrow, *vector]:
                try:
                    sec = graph_seconds(lambda n=name, b=blocks, ls=layers: [run_small(lay[n], b)() for lay in ls]) / L
                except Exception as e:  # a tiling the GPU cannot take (shared memory): skipped, and said
                    print(f"  {name} T={T} {blocks}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                timed.append((sec, blocks))
            sec, blocks = min(timed, key=lambda t: t[0])
            best[name] = blocks
            no_pdl = min(s for s, b in timed if not b.pdl)
            no_split = min(s for s, b in timed if b.splits == 1)
            cores = {v: min((s for s, b in timed if b.vector == v), default=float("nan")) for v in (False, True)}
            mb = proj[0].numel() * 2 / 1e6
            rows.append({"projection": name, "weights_mb": mb, "default_us": timed[0][0] * 1e6, "best_us": sec * 1e6,
                         "best": dataclasses.asdict(blocks),
                         "best_without_pdl_us": no_pdl * 1e6, "best_unsplit_us": no_split * 1e6,
                         "best_tensor_core_us": cores[False] * 1e6, "best_vector_us": cores[True] * 1e6,
                         "of_copy": mb * 1e6 / sec / bw})
        chain_small, chain_default, chain_matmul = chains(layers, best)
        weight_bytes = L * sum(p[0].numel() * 2 for p in projs.values())
        results["rows"][T] = {"projections": rows, "chain_best_s": chain_small, "chain_default_s": chain_default,
                              "chain_matmul_s": chain_matmul, "weight_bytes": weight_bytes}
        print(f"### {T} rows\n\n| projection | weights MB | default us | best us | best tiling | best without PDL us "
              "| best unsplit us | best tensor-core / vector us | of copy BW |\n|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            b = r["best"]
            print(f"| {r['projection']} | {r['weights_mb']:.1f} | {r['default_us']:.1f} | {r['best_us']:.1f} | "
                  f"n {b['n']} k {b['k']} warps {b['warps']} pdl {b['pdl']} splits {b['splits']} "
                  f"vector {b['vector']} | "
                  f"{r['best_without_pdl_us']:.1f} | {r['best_unsplit_us']:.1f} | {r['best_tensor_core_us']:.1f} / "
                  f"{r['best_vector_us']:.1f} | {r['of_copy']:.0%} |")
        print(f"\nthe {L} layers' projections in one graph: best tilings {chain_small * 1e3:.3f} ms, default tilings "
              f"{chain_default * 1e3:.3f} ms, matrix multiplies + fused norm/SiLU kernels {chain_matmul * 1e3:.3f} ms "
              f"({chain_matmul / chain_small:.2f}x); the weights' bytes at the copy's bandwidth "
              f"{weight_bytes / bw * 1e3:.3f} ms\n")
        if args.out:  # (after each row count: a call cut short keeps what it measured)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, default=str)


def chains(layers, best) -> tuple[float, float, float]:
    """Seconds of the layers' projections: best tilings, default tilings, the matrix multiplies' chain."""
    return (graph_seconds(lambda: [run_small(p, best[n])() for lay in layers for n, p in lay.items()]),
            graph_seconds(lambda: [run_small(p, None)() for lay in layers for p in lay.values()]),
            graph_seconds(lambda: [matmul_layer(lay) for lay in layers]))


def matmul_layer(projs) -> None:
    """One layer's projections as `Qwen3ForCausalLM._forward_fused` runs them, with the q/k norm and RoPE kernel
    (attention left out)."""
    w_qkv, x, norm, _, _, (q_norm, k_norm, positions, H, (k_cache, v_cache, slots)) = projs["qkv"]
    w_o, o, _, residual, _, _ = projs["o"]
    h, residual = fused.fused_add_rmsnorm(x, residual, norm, EPS)
    q, k, v = F.linear(h, w_qkv).split([H * k_cache.shape[2], k_cache[0].numel(), k_cache[0].numel()], dim=-1)
    T, D = x.shape[0], k_cache.shape[2]
    fused.qk_norm_rope(q.view(T, H, D), k.view(T, -1, D), q_norm, k_norm, positions, 1e6, EPS,
                       kv_cache=(v.view(T, -1, D), k_cache, v_cache, slots))
    h, residual = fused.fused_add_rmsnorm(F.linear(o, w_o), residual, norm, EPS)
    gate, up = F.linear(h, projs["gate_up"][0]).chunk(2, dim=-1)
    F.linear(fused.silu_mul(gate, up), projs["down"][0])


if __name__ == "__main__":
    main()
