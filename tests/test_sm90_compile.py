"""The decode step's few-row and attention kernels compile for an H100/H200 (sm_90) on a CPU machine, and the few-row
projections compile as the GPU's JIT compiles them without spills or idle pipeline stages.

Triton's CPU interpreter runs a kernel's body as Python, so code the compiler refuses can pass every interpreted
test: a variable whose shape differs between the branches of an `if` that is not a constexpr's, or
a name defined in one branch only. This compiles the variants the 0.6B shape's decode launches
(Triton's own ptxas, no GPU), in a process of its own: this one runs the interpreter.
"""

import functools

import pytest
import torch
from sm90 import run_compile_check

CHECK = """
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler.errors import CompilationError
from tandem.kernels import decode_attention, small_linear

def compile_sm90(jit, types, constexprs, warps=4, stages=2):
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in jit.arg_names}
    source = triton.compiler.ASTSource(fn=jit, signature=signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})

pointers = dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "o_ptr", "new_k_ptr", "new_v_ptr", "q_norm_ptr", "k_norm_ptr",
                          "x_ptr", "w_ptr", "out_ptr", "norm_w_ptr", "k_cache_ptr", "v_cache_ptr"], "*bf16")
pointers |= dict.fromkeys(["block_table_ptr", "seq_lens_ptr", "arrived_ptr"], "*i32")
pointers |= dict.fromkeys(["mid_o_ptr", "mid_lse_ptr", "inv_freq_ptr", "partial_ptr"], "*fp32")
pointers |= dict.fromkeys(["pos_ptr", "slots_ptr"], "*i64") | {"qk_scale_log2": "fp32", "eps": "fp32"}
cases = []
for name, fresh in (("_split_kernel", False), ("_split_kernel", True), ("_items_kernel", False)):
    cases.append((f"attention {name} fresh={fresh}", getattr(decode_attention, name), dict(
        GROUP=2, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16, BLOCK_H=16, BLOCK_N=32, DOT_DTYPE=tl.bfloat16,
        DOT_PRECISION="tf32", PDL=True, FRESH=fresh, LENS_BLOCK=decode_attention.LENS_BLOCK, INTERPRET=False), 2))
cases.append(("attention merge", decode_attention._merge_kernel,
              dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_SPLITS=64, BLOCK_N=32, LENS_BLOCK=decode_attention.LENS_BLOCK,
                   LOOP=True, PDL=True), 2))
for norm, residual, silu in ((True, False, True), (False, True, False), (True, False, False)):
    cases.append((f"few-row norm={norm} residual={residual} silu={silu}", small_linear._small_linear_kernel, dict(
        NORM=norm, RESIDUAL=residual, SILU=silu, HEADS=False, SPLITS=1, BLOCK_T=1, BLOCK_N=4, BLOCK_K=1024,
        NORM_BLOCK=1024, DOT_FP32=False, VECTOR=True, PDL=True, EARLY_RESIDUAL=True, INTERPRET=False), 1))
cases.append(("few-row split residual, tensor cores", small_linear._small_linear_kernel, dict(
    NORM=False, RESIDUAL=True, SILU=False, HEADS=False, SPLITS=4, BLOCK_T=16, BLOCK_N=16, BLOCK_K=256,
    NORM_BLOCK=256, DOT_FP32=False, VECTOR=False, PDL=True, EARLY_RESIDUAL=True, INTERPRET=False), 3))
cases.append(("few-row q/k/v heads, split", small_linear._small_linear_kernel, dict(
    NORM=True, RESIDUAL=False, SILU=False, HEADS=True, SPLITS=16, BLOCK_T=1, BLOCK_N=64, BLOCK_K=64,
    NORM_BLOCK=1024, DOT_FP32=False, VECTOR=True, PDL=True, EARLY_RESIDUAL=True, INTERPRET=False), 1))
failed = {}
for name, jit, constexprs, stages in cases:
    try:
        compile_sm90(jit, pointers, constexprs, stages=stages)
    except CompilationError as e:  # the kernel's own code
        failed[name] = str(e)[-1500:]
    except Exception as e:  # the toolchain: no ptxas, no sm_90 backend
        print(json.dumps({"skip": f"{type(e).__name__}: {e}"[:300]}))
        sys.exit(0)
print(json.dumps({"compiled": len(cases) - len(failed), "failed": failed}))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU's check of the code a GPU would run")
def test_decode_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    found = run_compile_check(CHECK)
    assert not found["failed"], "\n\n".join(f"{name}:\n{error}" for name, error in found["failed"].items())
    assert found["compiled"] == 9


RESOURCES = """
import json, sys
sys.path.insert(0, "benchmarks")
import kernel_resources as kr
from tandem.config import PRESETS
from tandem.kernels import small_linear

small_linear._multiprocessors, small_linear.pdl_supported = (lambda device: 132), (lambda device: True)
found = {}
try:
    for rows in (1, 2, 8):
        for name, (N, E, keywords, call) in kr.projection_calls(PRESETS["qwen3-0.6b"], rows).items():
            blocks = small_linear.default_blocks(N, E, kr.H100(), rows=rows, **keywords)
            [launch] = kr.launches(small_linear, ("_small_linear_kernel",), lambda b=blocks, c=call: c(b))
            found.setdefault(rows, {})[name] = dict(zip(("registers", "spilled", "shared", "barriers", "early"),
                                                         kr.resources(*launch)))
            if name in ("o", "down"):  # (the same launch reading its residual after the wait)
                early, small_linear.EARLY_RESIDUAL = small_linear.EARLY_RESIDUAL, False
                [late] = kr.launches(small_linear, ("_small_linear_kernel",), lambda b=blocks, c=call: c(b))
                small_linear.EARLY_RESIDUAL = early
                found[rows][name]["early_when_late"] = kr.resources(*late)[4]
except Exception as e:  # the toolchain: no ptxas, no sm_90 backend
    print(json.dumps({"skip": f"{type(e).__name__}: {e}"[:300]}))
    sys.exit(0)
print(json.dumps(found))
"""


@functools.cache
def projection_resources() -> dict:
    pytest.importorskip("triton")
    return run_compile_check(RESOURCES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU's check of the code a GPU would run")
def test_few_row_projections_at_8_rows_neither_spill_nor_fill_an_sm():
    """Compiled as the GPU's JIT compiles the model's own launches: no projection spills registers, and none takes
    shared memory for pipeline stages its programs cannot fill (q/k/v's programs hold a single tile each)."""
    found = projection_resources()["8"]
    assert set(found) == {"q/k/v", "o", "gate/up", "down"}
    for name, r in found.items():
        assert r["spilled"] == 0 and r["shared"] <= 64 * 1024, (name, r)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU's check of the code a GPU would run")
@pytest.mark.parametrize("rows", [1, 2])
def test_one_or_two_rows_weight_tiles_never_pass_through_shared_memory(rows):
    """At the rows a step's products are summed a row at a time (`small_linear.ROWWISE_ROWS`), each projection
    uses shared memory for its reductions' partial sums only: summed as one 3-d product, the compiler stages the
    whole weight tile there to change its layout, with a barrier around each piece."""
    found = projection_resources()[str(rows)]
    assert set(found) == {"q/k/v", "o", "gate/up", "down"}
    for name, r in found.items():
        assert r["spilled"] == 0 and r["shared"] <= 1024, (name, r)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU's check of the code a GPU would run")
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_residual_projections_read_the_residual_before_their_dependent_wait(rows):
    """o and down add into the residual stream, which the kernel just before them never writes: compiled as the
    JIT compiles the model's launches, each reads it before its dependent wait (one global load more there than
    the same launch reading it after), so its latency is not on the step's chain of dependent kernels."""
    found = projection_resources()[str(rows)]
    for name in ("o", "down"):
        assert found[name]["early"] > found[name]["early_when_late"], (name, found[name])
