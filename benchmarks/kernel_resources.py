"""What a decode step's few-row projections cost an H100/H200's SM in registers, spills and shared memory, found on a
CPU: each tiling compiled for sm_90 by Triton's own compiler and ptxas, as the GPU would (no GPU needed).

    python benchmarks/kernel_resources.py [--model qwen3-0.6b] [--rows 1 4 8 16] [--k 128 256] [--warps 4 8]

For each row count, each projection of a dense layer (q/k/v with its head epilogue, o with the residual add, gate/up
with the norm and SiLU, down with the residual add) at `small_linear.default_blocks`' tiling, then, above
`VECTOR_ROWS` rows, every other tensor-core tile width (`--k`, input columns a tile) and warp count (`--warps`).
Registers past 255 a thread spill to local memory: a spilled kernel waits on memory the weights do not need. A count
of registers, not a timing: which tiling is fastest only a GPU says (`small_linear_blocks.py`).
Run with TRITON_INTERPRET unset (the interpreter's kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas

from tandem.config import PRESETS
from tandem.kernels import small_linear

ARCH, SM_REGISTERS = 90, 65536
TYPES = dict.fromkeys(["x_ptr", "w_ptr", "out_ptr", "norm_w_ptr", "q_norm_ptr", "k_norm_ptr", "k_cache_ptr",
                       "v_cache_ptr"], "*bf16") | dict.fromkeys(["partial_ptr", "inv_freq_ptr"], "*fp32") | {
    "arrived_ptr": "*i32", "pos_ptr": "*i64", "slots_ptr": "*i64", "eps": "fp32"}


class H100:  # what `default_blocks` asks of the device
    type = "cuda"


def resources(blocks: small_linear.Blocks, rows: int, E: int, head_dim: int | None, norm: bool, residual: bool,
              silu: bool) -> tuple[int, int, int]:
    """(registers a thread, bytes spilled a thread, shared memory bytes) of `_small_linear_kernel` as
    `small_linear._launch` launches it at this tiling (`head_dim`: `small_qkv`'s, a program a head)."""
    block_t = triton.next_power_of_2(rows) if blocks.vector else small_linear.MAX_ROWS
    constexprs = dict(NORM=norm, RESIDUAL=residual, SILU=silu, HEADS=head_dim is not None, SPLITS=blocks.splits,
                      BLOCK_T=block_t, BLOCK_N=head_dim // 2 if head_dim else blocks.n, BLOCK_K=blocks.k,
                      NORM_BLOCK=max(blocks.k, min(triton.next_power_of_2(E), 4096 // block_t)), DOT_FP32=False,
                      VECTOR=blocks.vector, PDL=True, INTERPRET=False)
    jit = small_linear._small_linear_kernel
    signature = {n: "constexpr" if n in constexprs else TYPES.get(n, "i32") for n in jit.arg_names}
    kernel = triton.compile(triton.compiler.ASTSource(jit, signature, constexprs=constexprs),
                            target=GPUTarget("cuda", ARCH, 32),
                            options={"num_warps": blocks.warps, "num_stages": blocks.stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        report = subprocess.run([get_ptxas(ARCH).path, f"-arch=sm_{ARCH}a", "--verbose", ptx.name, "-o",
                                 "/dev/null"], capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spilled = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return registers, spilled, kernel.metadata.shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--k", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--sms", type=int, default=132, help="multiprocessors (an H100 SXM's 132)")
    args = parser.parse_args()
    cfg = PRESETS[args.model]
    small_linear._multiprocessors = lambda device: args.sms
    small_linear.pdl_supported = lambda device: True
    E, H, K, D, inter = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.intermediate_size)
    # name -> (N, E, default_blocks' keywords, head dim (a program a head), norm, residual, silu)
    projections = {"q/k/v": ((H + 2 * K) * D, E, {"heads": H + 2 * K}, D, True, False, False),
                   "o": (E, H * D, {}, None, False, True, False),
                   "gate/up": (inter, E, {"paired": True}, None, True, False, True),
                   "down": (E, inter, {}, None, False, True, False)}
    print(f"## few-row projections' sm_{ARCH} resources ({args.model}, {args.sms} SMs; Triton {triton.__version__})\n")
    print("| rows | projection | tiling | programs | registers a thread | spilled bytes a thread | shared KiB | "
          "programs an SM (registers) |\n|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        for name, (N, E_in, keywords, head_dim, norm, residual, silu) in projections.items():
            default = small_linear.default_blocks(N, E_in, H100(), rows=rows, **keywords)
            tilings = [default]
            if not default.vector:
                tilings += [dataclasses.replace(default, k=k, warps=w) for k, w in itertools.product(args.k, args.warps)
                            if (k, w) != (default.k, default.warps)]
            column_blocks = keywords.get("heads") or triton.cdiv(N, default.n)
            for blocks in tilings:
                k_split = triton.cdiv(triton.cdiv(E_in, blocks.splits), blocks.k) * blocks.k
                registers, spilled, shared = resources(blocks, rows, E_in, head_dim, norm, residual, silu)
                tag = "default: " if blocks is default else ""
                width = f"2 x {head_dim // 2}" if head_dim else blocks.n
                print(f"| {rows} | {name} | {tag}{width} x {blocks.k}, {blocks.warps} warps, {blocks.splits} "
                      f"split(s){', vector' if blocks.vector else ''} | {column_blocks * triton.cdiv(E_in, k_split)} "
                      f"| {registers} | {spilled} | {shared / 1024:.0f} | "
                      f"{SM_REGISTERS // (registers * 32 * blocks.warps)} |")


if __name__ == "__main__":
    main()
