"""What a decode step's few-row projections and decode attention cost an H100/H200's SM in registers, spills,
shared memory and block-wide barriers, found on a CPU: each launch compiled for sm_90 by Triton's own compiler and
ptxas, as the GPU's JIT would compile it (no GPU needed).

    python benchmarks/kernel_resources.py [--model qwen3-0.6b] [--rows 1 4 8 16] [--k 128 256] [--warps 4 8]
                                          [--rowwise R]

For each row count, each projection of a dense layer as the model launches it (q/k/v with its head epilogue, plain up
to `FRESH_ROWS` rows; o with the residual add, gate/up with the norm and SiLU, down with the residual add) at
`small_linear.default_blocks`' tiling, then, above `VECTOR_ROWS` rows, every other tensor-core tile width (`--k`,
input columns a tile) and warp count (`--warps`); then decode attention's kernels at as many requests of 1,024
positions. Each launch is captured as the model makes it (on CPU tensors) and its arguments specialised as the JIT
specialises them: compiled without that, the same kernel loads two bytes an instruction and spills registers it does
not spill on the GPU. Registers past 255 a thread spill to local memory; registers, shared memory and warps bound the
programs an SM holds. Counts, not timings: which tiling is fastest only a GPU says (`small_linear_blocks.py`).
Run with TRITON_INTERPRET unset (the interpreter's kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.backends.nvidia.compiler import get_ptxas

from tandem.config import PRESETS
from tandem.kernels import decode_attention, small_linear
from tandem.model.attention import Fresh

ARCH, SM_REGISTERS, SM_SHARED = 90, 65536, 233472  # an H100's or H200's SM (228 KiB of shared memory)


class H100:  # what `default_blocks` asks of the device
    type = "cuda"


def launches(module, names: tuple[str, ...], call) -> list[tuple[object, tuple, dict]]:
    """(kernel, arguments, keywords) of each launch of `module`'s kernels `names` that `call()` makes, captured
    instead of run (on CPU tensors: what a launch passes is all that is needed)."""
    captured, kernels = [], {name: getattr(module, name) for name in names}

    class Capture:
        def __init__(self, jit):
            self.jit = jit

        def __getitem__(self, grid):
            return lambda *args, **kwargs: captured.append((self.jit, args, kwargs))

    for name, jit in kernels.items():
        setattr(module, name, Capture(jit))
    try:
        call()
    finally:
        for name, jit in kernels.items():
            setattr(module, name, jit)
    return captured


def resources(jit, args: tuple, kwargs: dict) -> tuple[int, int, int, int, int]:
    """(registers a thread, bytes spilled a thread, shared memory bytes, block-wide barriers in its SASS, both
    copies of a peeled loop counted, global loads in its SASS before its first dependent wait (`ACQBULK`; all of
    them without one)) of `jit` launched with `args` and `kwargs`,
    compiled for sm_90 as Triton's JIT would compile that launch: each argument specialised as the JIT specialises
    it (unless the kernel says not to: an integer 1 a constant; a multiple of 16, or a 16-byte aligned pointer,
    known divisible by 16, which is what lets loads be vectorised)."""
    constexprs = {name: kwargs[name] for name in jit.arg_names if name in kwargs}
    signature, attrs = {}, {}
    for i, (param, value) in enumerate(zip(jit.params, args, strict=False)):  # (the constexprs come as keywords)
        kind, spec = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                            not param.do_not_specialize_on_alignment)
        if kind == "constexpr":
            constexprs[param.name] = spec
        elif spec == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
        signature[param.name] = kind
    signature.update((name, "constexpr") for name in constexprs)
    options = {"num_warps": kwargs.get("num_warps", 4), "num_stages": kwargs.get("num_stages", 3),
               "enable_fp_fusion": kwargs.get("enable_fp_fusion", True)}
    kernel = triton.compile(triton.compiler.ASTSource(jit, signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", ARCH, 32), options=options)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        report = subprocess.run([get_ptxas(ARCH).path, f"-arch=sm_{ARCH}a", "--verbose", ptx.name, "-o",
                                 "/dev/null"], capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spilled = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([os.path.join(os.path.dirname(get_ptxas(ARCH).path), "nvdisasm"), "-c", cubin.name],
                              capture_output=True, text=True, check=True).stdout
    early = len(re.findall(r"\bLDG\b", sass.split("ACQBULK")[0]))
    return registers, spilled, kernel.metadata.shared, len(re.findall(r"\bBAR\.SYNC", sass)), early


def per_sm(registers: int, shared: int, warps: int) -> int:
    """Programs an SM holds at once: the fewest its registers, shared memory and warp slots allow."""
    return min(SM_REGISTERS // (registers * 32 * warps), SM_SHARED // (shared + 1024) if shared else 32, 64 // warps)


def attention_call(cfg, batch: int, fresh: bool, context: int = 1024, page_size: int = 16) -> None:
    """Decode attention as a decode step of `batch` requests at `context` positions launches it (CPU tensors)."""
    H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pages = context // page_size
    cache = torch.zeros(batch * pages * page_size, K, D, dtype=torch.bfloat16)
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.zeros(batch, H, D, dtype=torch.bfloat16)
    new = None
    if fresh:
        kv = torch.zeros(batch, K, D, dtype=torch.bfloat16)
        new = Fresh(kv, kv.clone(), torch.ones(D, dtype=torch.bfloat16), torch.ones(D, dtype=torch.bfloat16),
                    torch.arange(batch), torch.arange(batch), 1e6, 1e-6)
    decode_attention.paged_decode_attention(q, cache, cache.clone(), table, lens, page_size, D ** -0.5, fresh=new)


def projection_calls(cfg, rows: int) -> dict:
    """name -> (N, E, default_blocks' keywords, call(blocks)): each projection of a dense layer as the model launches
    it at `rows` rows (q/k/v with its head epilogue above `FRESH_ROWS`, plain up to it), on CPU tensors of its
    shapes."""
    E, H, K, D, inter = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.intermediate_size)
    arrived = small_linear.arrival_counts("cpu")

    def t(*shape):
        return torch.zeros(*shape, dtype=torch.bfloat16)

    def qkv(blocks):
        caches = (t(rows, K, D), t(rows, K, D), torch.arange(rows))
        small_linear.small_qkv(t(rows, E), t((H + 2 * K) * D, E), t(E), 1e-6, t(D), t(D), torch.arange(rows), 1e6,
                               H, caches, arrived, blocks)

    if rows <= small_linear.FRESH_ROWS:  # a plain projection: attention takes q/k norm, RoPE and the KV write
        qkv_entry = ((H + 2 * K) * D, E, {}, lambda b: small_linear.small_linear(t(rows, E), t((H + 2 * K) * D, E),
                                                                                t(E), 1e-6, blocks=b, arrived=arrived))
    else:
        qkv_entry = ((H + 2 * K) * D, E, {"heads": H + 2 * K}, qkv)
    return {"q/k/v": qkv_entry,
            "o": (E, H * D, {}, lambda b: small_linear.small_linear(t(rows, H * D), t(E, H * D), out=t(rows, E),
                                                                    blocks=b, arrived=arrived)),
            "gate/up": (inter, E, {"paired": True},
                        lambda b: small_linear.small_linear(t(rows, E), t(2 * inter, E), t(E), 1e-6, silu=True,
                                                            blocks=b, arrived=arrived)),
            "down": (E, inter, {}, lambda b: small_linear.small_linear(t(rows, inter), t(E, inter), out=t(rows, E),
                                                                       blocks=b, arrived=arrived))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--k", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--sms", type=int, default=132, help="multiprocessors (an H100 SXM's 132)")
    parser.add_argument("--rowwise", type=int, help="small_linear.ROWWISE_ROWS (default "
                        f"{small_linear.ROWWISE_ROWS}; 0: every vector tile's products summed as one 3-d product)")
    parser.add_argument("--vector-rows", type=int, help="small_linear.VECTOR_ROWS (default "
                        f"{small_linear.VECTOR_ROWS}: rows up to which projections take vector tiles)")
    args = parser.parse_args()
    if args.rowwise is not None:
        small_linear.ROWWISE_ROWS = args.rowwise
    if args.vector_rows is not None:
        small_linear.VECTOR_ROWS = args.vector_rows
    cfg = PRESETS[args.model]
    small_linear._multiprocessors = decode_attention._num_sms = lambda device: args.sms
    small_linear.pdl_supported = decode_attention.pdl_supported = lambda device: True
    print(f"## few-row projections' sm_{ARCH} resources ({args.model}, {args.sms} SMs; Triton {triton.__version__}; "
          f"products a row at a time up to {small_linear.ROWWISE_ROWS} rows)\n")
    print("| rows | projection | tiling | programs | registers a thread | spilled bytes a thread | shared bytes | "
          "barriers | programs an SM (registers, shared memory, warps) |\n|---|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        for name, (N, E_in, keywords, call) in projection_calls(cfg, rows).items():
            default = small_linear.default_blocks(N, E_in, H100(), rows=rows, **keywords)
            tilings = [default]
            if not default.vector:
                tilings += [dataclasses.replace(default, k=k, warps=w) for k, w in itertools.product(args.k, args.warps)
                            if (k, w) != (default.k, default.warps)]
            for blocks in tilings:
                [launch] = launches(small_linear, ("_small_linear_kernel",), lambda b=blocks, c=call: c(b))
                registers, spilled, shared, barriers, _ = resources(*launch)
                k_split = triton.cdiv(triton.cdiv(E_in, blocks.splits), blocks.k) * blocks.k
                column_blocks = keywords.get("heads") or triton.cdiv(N, blocks.n)
                tag = "default: " if blocks is default else ""
                width = f"2 x {cfg.head_dim // 2}" if "heads" in keywords else blocks.n
                print(f"| {rows} | {name} | {tag}{width} x {blocks.k}, {blocks.warps} warps, {blocks.splits} "
                      f"split(s){', vector' if blocks.vector else ''} | {column_blocks * triton.cdiv(E_in, k_split)} "
                      f"| {registers} | {spilled} | {shared} | {barriers} | "
                      f"{per_sm(registers, shared, blocks.warps)} |")
    print("\n| requests | decode attention kernel | registers a thread | spilled bytes a thread | shared bytes | "
          "barriers | programs an SM |\n|---|---|---|---|---|---|---|")
    for batch in args.rows:
        for fresh in (False, True):
            for jit, launch_args, launch_kwargs in launches(decode_attention, ("_split_kernel", "_merge_kernel"),
                                                            lambda b=batch, f=fresh: attention_call(cfg, b, f)):
                if jit is decode_attention._merge_kernel and fresh:
                    continue  # (the same merge)
                registers, spilled, shared, barriers, _ = resources(jit, launch_args, launch_kwargs)
                name = "merge" if jit is decode_attention._merge_kernel else f"first stage{', fresh keys' * fresh}"
                print(f"| {batch} | {name} | {registers} | {spilled} | {shared} | {barriers} | "
                      f"{per_sm(registers, shared, launch_kwargs['num_warps'])} |")


if __name__ == "__main__":
    main()
