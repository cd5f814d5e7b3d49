"""The floor of one kernel in a decode step's chain of dependent kernels, on a GPU.

    python benchmarks/kernel_floor.py [--kernels 28] [--programs 256] [--rows 8] [--width 1024]

A decode step of a few rows runs its kernels one after another, and each costs a fixed time besides its bytes
(BENCHMARKS.md, "Few-row kernels"). This times chains of `--kernels` synthetic kernels, each chain captured in
one CUDA graph, each kernel a programmatic dependent launch (PDL) as the step's are, or a plain launch, and prints
microseconds a kernel for:
  (a) empty: every program waits for the kernel before (PDL), lets the next one launch, and exits;
  (b) hop: (a), then every program reads the row of `--width` values the kernel before wrote and writes one value;
  (c) weights: (b), but every program first loads a tile of `--rows` x `--width` bf16 weights of its kernel's own
      (before its wait, as the few-row projections do) and writes the tile's products with the row: a vector
      projection's shape, its weights read from memory, not L2.
(b) - (a) is a dependent round trip through L2; (c) against its bytes at the copy's bandwidth (measured in the same
run) is the fixed cost of a projection without the norm, the residual or the split that the real ones add.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import triton
import triton.language as tl
from decode_attention_bench import copy_bandwidth, graph_seconds_per_call

from tandem.kernels.fused import gdc_launch_dependents, gdc_wait, pdl_supported


@triton.jit
def _link(x_ptr, y_ptr, w_ptr, WIDTH: tl.constexpr, ROWS: tl.constexpr, HOP: tl.constexpr, WEIGHTS: tl.constexpr,
          PDL: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, WIDTH)
    rows = pid * ROWS + tl.arange(0, ROWS)
    w = tl.zeros([ROWS, WIDTH], tl.bfloat16)
    if WEIGHTS:
        w = tl.load(w_ptr + rows[:, None] * WIDTH + cols[None, :])
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if HOP:
        x = tl.load(x_ptr + cols).to(tl.float32)
        if WEIGHTS:
            tl.store(y_ptr + rows, tl.sum(w.to(tl.float32) * x[None, :], 1).to(tl.bfloat16))
        else:
            tl.store(y_ptr + pid, tl.sum(x, 0).to(tl.bfloat16))


def chain_seconds(kernels: int, programs: int, rows: int, width: int, hop: bool, weights: bool, pdl: bool) -> float:
    """Seconds a kernel in a graph of `kernels` dependent launches (`graph_seconds_per_call`)."""
    outputs = max(width, programs * rows)
    buffers = [torch.ones(outputs, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    tiles = [torch.randn(programs * rows, width, dtype=torch.bfloat16, device="cuda") if weights else buffers[0]
             for _ in range(kernels)]
    launch = {"launch_pdl": True} if pdl else {}

    def link(i: int):
        return lambda: _link[(programs,)](buffers[i % 2], buffers[1 - i % 2], tiles[i], WIDTH=width, ROWS=rows,
                                          HOP=hop, WEIGHTS=weights, PDL=pdl, num_warps=4, **launch)
    return graph_seconds_per_call([link(i) for i in range(kernels)], replays=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=28, help="kernels a chain (a graph)")
    parser.add_argument("--programs", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--rows", type=int, default=8, help="weight rows a program in (c)")
    parser.add_argument("--width", type=int, default=1024, help="the row's values (a power of two)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_floor: needs a GPU")
    bw = copy_bandwidth()  # read + write
    pdl = pdl_supported(torch.device("cuda"))
    print(f"## kernel floor ({datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__})\ncommand: python {' '.join(sys.argv)}\ndevice-to-device copy: "
          f"{bw / 1e12:.2f} TB/s; PDL {'on' if pdl else 'not supported here'}\n")
    print("| programs | (a) empty us, PDL / plain | (b) hop us, PDL / plain | (c) weights us, PDL / plain | (c)'s "
          "bytes at the copy's bandwidth us |\n|---|---|---|---|---|")
    for programs in args.programs:
        cells = []
        for hop, weights in ((False, False), (True, False), (True, True)):
            modes = (True, False) if pdl else (False,)
            times = [chain_seconds(args.kernels, programs, args.rows, args.width, hop, weights, m) for m in modes]
            cells.append(" / ".join(f"{t * 1e6:.2f}" for t in times) + ("" if pdl else " (plain)"))
        tile_bytes = programs * args.rows * args.width * 2
        print(f"| {programs} | {' | '.join(cells)} | {tile_bytes / bw * 1e6:.2f} |")


if __name__ == "__main__":
    main()
