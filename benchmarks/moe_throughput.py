"""Qwen3-MoE serving on one GPU, with its references measured in the same run.

    python benchmarks/moe_throughput.py [--model qwen3-30b-a3b] [--out moe.json]
    python benchmarks/moe_throughput.py --model tiny-moe --device cpu --quick     (a smoke run on a CPU)

Random bf16 weights (the engine's own seeded init), CUDA graphs and fused kernels on (the engine's defaults).
(a) Hugging Face generate over the same weights (transformers' Qwen3MoeForCausalLM, its parameters the engine
    model's own tensors: no second copy; its default experts implementation, which transformers 5 switches from
    grouped_mm to batched_mm for decoding on a GPU): prompt 128, `--new-tokens` 64, greedy, fixed lengths, at each
    `--batches` size. Measured first and freed before the engine sizes its KV pool from free memory.
(b) nano-vllm's workload (`--num-seqs` sequences, prompt and output lengths uniform in [100, 1024], seeded,
    ignore_eos) through `Engine.generate`: output tokens per second, and against HF's best batch.
(c) the jobs of (a) through the engine, and the decode step of (d), against HF at each batch size.
(d) decode sweep at `--context` tokens per row: one step timed; achieved bandwidth = the bytes the step must read
    / step time. Those bytes: every weight but the experts and the embedding (attention, norms, routers, dense
    MLPs, lm_head), the embedding rows of the batch, the experts the step routed to (distinct ids per MoE layer,
    recorded by hooks on an eager run of the same step), and each row's KV. Against a device-to-device copy.
(e) `torch.profiler` over the decode step at `--profile-batch`: the top kernels (on a CPU: the top operators).
(f) `--routing-return` (instead of (a)-(e)): the workload of (b) with and without every request returning its
    routed experts (`return_routed_experts`), twice each in turn, on one engine that keeps the routing.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import platform
import random
import sys
import time

import torch
from engine_throughput import (
    copy_bandwidth,
    decode_step,
    parse_with_quick,
    profile_workload,
    run_workload,
    seconds_per_call,
    workload,
)

from tandem.config import EngineConfig, resolve_model
from tandem.distributed.parallel import cdiv
from tandem.engine.engine import Engine
from tandem.kernels import moe as moe_kernels
from tandem.model.loader import build_model
from tandem.model.moe import route
from tandem.model.qwen3 import Qwen3ForCausalLM
from tandem.run.heap import frozen_heap
from tandem.types import SamplingParams

PROMPT_LEN = 128  # of the Hugging Face comparison's job
QUICK = dict(num_seqs=8, lengths=[16, 64], batches=[1, 8], new_tokens=16, profile_batch=8, iters=3)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def job_prompts(batch: int, vocab_size: int) -> list[list[int]]:
    """The fixed-length prompts of the HF comparison at `batch` (seeded by it)."""
    rng = random.Random(batch)
    return [[rng.randrange(vocab_size) for _ in range(PROMPT_LEN)] for _ in range(batch)]


# ---- (a) Hugging Face ------------------------------------------------------------------------------------------
def hf_twin(model: Qwen3ForCausalLM):
    """transformers' Qwen3MoeForCausalLM whose parameters are `model`'s own tensors (the names are the same)."""
    import transformers

    hf_config = transformers.Qwen3MoeConfig(**{k: v for k, v in model.config.to_hf_dict().items()
                                               if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(hf_config)
    hf.load_state_dict(model.state_dict(), assign=True)  # strict: every parameter, by name
    device = next(model.parameters()).device
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_config).to(device)  # buffers no state dict carries
    assert not any(t.is_meta for t in [*hf.parameters(), *hf.buffers()]), "a tensor of the twin was not set"
    return hf.eval()


def hf_generate(hf, batch: int, new_tokens: int, device: torch.device) -> tuple[float, list[int]]:
    """(tokens per second, each row's first new token)."""
    ids = torch.tensor(job_prompts(batch, hf.config.vocab_size), device=device)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    sync(device)
    elapsed = time.perf_counter() - t0
    assert out.shape == (batch, PROMPT_LEN + new_tokens)
    return batch * new_tokens / elapsed, out[:, PROMPT_LEN].tolist()


# ---- (b), (c) the engine ---------------------------------------------------------------------------------------
async def engine_job(engine: Engine, batch: int, new_tokens: int) -> tuple[float, list[int]]:
    """The HF comparison's job through the engine (greedy, ignore_eos, all requests at once): (tokens per second,
    each row's first new token)."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    prompts = job_prompts(batch, engine.model_config.vocab_size)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[engine.generate(p, params) for p in prompts])
    elapsed = time.perf_counter() - t0
    assert all(len(o.output_ids) == new_tokens for o in outs)
    return batch * new_tokens / elapsed, [o.output_ids[0] for o in outs]


# ---- (d) decode sweep ------------------------------------------------------------------------------------------
def sweep_step(engine: Engine, batch: int, context: int, gen: torch.Generator):
    """`decode_step` with random input ids (the same token in every row would route every row alike)."""
    step = decode_step(engine, batch, context)
    ids = torch.randint(engine.model_config.vocab_size, (batch,), generator=gen)
    engine.runner.decode_in.views(batch)["ids"].copy_(ids)
    return step


def torch_routing_step_seconds(engine: Engine, batch: int, context: int, iters: int) -> float:
    """One decode step (a graph of its own, captured here) with the routing by PyTorch ops: `route` and the sorted
    grouping instead of `tandem.kernels.moe_routing`'s one launch each (the same-run A/B of those kernels)."""
    blocks = engine.model.moe_blocks
    kernels, upto = [b.route_kernel for b in blocks], moe_kernels.GROUP_IN_ONE_LAUNCH_UPTO
    width = cdiv(context, engine.pool.page_size)
    for b in blocks:
        b.route_kernel = None
    moe_kernels.GROUP_IN_ONE_LAUNCH_UPTO = 0
    try:
        with torch.inference_mode():
            engine.runner._forward_decode(batch, width)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                engine.runner._forward_decode(batch, width)
            seconds = seconds_per_call(graph.replay, iters, engine.runner.device)
        del graph
        return seconds
    finally:
        for b, kernel in zip(blocks, kernels, strict=True):
            b.route_kernel = kernel
        moe_kernels.GROUP_IN_ONE_LAUNCH_UPTO = upto


def experts_touched(model: Qwen3ForCausalLM, step) -> list[int]:
    """Run `step` (an eager forward) once; the number of distinct experts each MoE layer routed its tokens to.
    A pre-hook on each sparse block routes the block's input by the model's own rule (`route`)."""
    counts: list[int] = []

    def record(block, args):
        _, ids_TK = route(block.gate(args[0]), block.top_k, block.normalize)
        counts.append(int(ids_TK.unique().numel()))

    handles = [block.register_forward_pre_hook(record) for block in model.moe_blocks]
    try:
        step()
    finally:
        for handle in handles:
            handle.remove()
    if len(counts) != len(model.moe_blocks):
        raise RuntimeError(f"the routing hooks fired {len(counts)} times for {len(model.moe_blocks)} MoE layers: "
                           "the forward no longer calls each Qwen3SparseMoeBlock")
    return counts


def step_bytes(model: Qwen3ForCausalLM, batch: int, context: int, touched: list[int]) -> dict[str, int]:
    """The bytes one decode step must read, by kind (see the module docstring)."""
    cfg = model.config
    dense = embed = 0
    for name, p in model.named_parameters(remove_duplicate=False):  # (a tied lm_head counts under its own name)
        if "embed_tokens" in name:
            embed = batch * p.shape[-1] * p.element_size()
        elif ".experts." not in name:
            dense += p.numel() * p.element_size()
    experts = model.moe_blocks[0].experts
    per_expert = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * experts.down_proj.element_size()
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * experts.down_proj.element_size()
    return {"dense": dense + embed, "experts": sum(touched) * per_expert, "kv": batch * context * kv_per_token}


def expected_experts(batch: int, num_experts: int, k: int) -> float:
    """The distinct experts a MoE layer reads for `batch` tokens that each route to k distinct experts uniformly
    at random (random weights route about so; (d) prints the counts measured beside it)."""
    return num_experts * (1 - (1 - k / num_experts) ** batch)


def bandwidth_bound(prompts, outputs, model: Qwen3ForCausalLM, bandwidth: float) -> float:
    """Output tokens a second that the workload's bytes allow, as `engine_throughput.bandwidth_bound` for a dense
    model: every decode step reads `step_bytes` for the sequences still running (the experts their tokens are
    expected to touch, `expected_experts`) at `bandwidth`; prefill's compute and the KV writes left out, so no run
    can beat it."""
    cfg, blocks = model.config, len(model.moe_blocks)
    one = step_bytes(model, 1, 1, [1])  # the dense weights and one row's embedding, one expert, one token's KV
    seconds = 0.0
    for s in range(max(outputs)):
        contexts = [len(p) + s for p, n in zip(prompts, outputs, strict=True) if n > s]
        touched = blocks * expected_experts(len(contexts), cfg.num_experts, cfg.num_experts_per_tok)
        seconds += (one["dense"] + touched * one["experts"] + sum(contexts) * one["kv"]) / bandwidth
    return sum(outputs) / seconds


# ---- (e) profile -----------------------------------------------------------------------------------------------
def top_kernels(step, device: torch.device, steps: int = 5, top: int = 12) -> tuple[list[dict], float, float]:
    """(the top kernels of `steps` calls of `step` by time, per step; the step's total kernel microseconds; its
    kernel launches). On a CPU the rows are operators by self CPU time, and the launches operator calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    step()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        for _ in range(steps):
            step()
        sync(device)
    if cuda:
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        us = lambda e: e.self_device_time_total
    else:
        events = list(prof.key_averages())
        us = lambda e: e.self_cpu_time_total
    total = sum(us(e) for e in events) / steps
    rows = [{"kernel": e.key[:100], "calls": e.count / steps, "us": us(e) / steps, "share": us(e) / steps / total}
            for e in sorted(events, key=us, reverse=True)[:top]]
    return rows, total, sum(e.count for e in events) / steps


def print_tables(results: dict, args: argparse.Namespace, num_experts: int, bw: float) -> None:
    sweep = results["decode"]
    if "hf_tok_s" in results:
        hf_tok_s, job_tok_s = results["hf_tok_s"], results["engine_job_tok_s"]
        print(f"(c) against HF generate at each batch ({PROMPT_LEN} in, {args.new_tokens} out): the same job "
              f"through the engine, and the decode step of (d) at context {args.context}:\n")
        print("| batch | HF generate tok/s | tandem, same job tok/s | tandem / HF | decode step (d) tok/s | (d) / HF "
              "|\n|---|---|---|---|---|---|")
        for row in sweep:
            b = row["batch"]
            print(f"| {b} | {hf_tok_s[b]:,.1f} | {job_tok_s[b]:,.0f} | {job_tok_s[b] / hf_tok_s[b]:.1f}x | "
                  f"{row['tok_s']:,.0f} | {row['tok_s'] / hf_tok_s[b]:.1f}x |")
    print(f"\n(d) decode step at context {args.context} ({args.iters} steps timed a batch size); bytes = dense "
          "weights + embedding rows, touched experts, KV:\n")
    print("| batch | step ms | tok/s | experts touched / layer (min-max; uniform routing's expectation) | dense + "
          "experts + KV GB | achieved GB/s | of copy BW |\n|---|---|---|---|---|---|---|")
    for row in sweep:
        t, gb = row["experts_touched"], {k: v / 1e9 for k, v in row["bytes"].items()}
        print(f"| {row['batch']} | {row['step_s'] * 1e3:.2f} | {row['tok_s']:,.0f} | {sum(t) / len(t):.1f} of "
              f"{num_experts} ({min(t)}-{max(t)}; {row['expected_experts']:.1f}) | {gb['dense']:.2f} + "
              f"{gb['experts']:.2f} + {gb['kv']:.2f} | {row['bytes_per_s'] / 1e9:,.0f} | "
              f"{row['bytes_per_s'] / bw:.0%} |")
    profile = results["profile"]
    what = "kernels" if args.device.startswith("cuda") else "operators (CPU: self time)"
    print(f"\n(e) one decode step at batch {profile['batch']}, context {args.context}, by torch.profiler: "
          f"{profile['kernel_us_per_step'] / 1e3:.2f} ms in {profile['launches_per_step']:,.0f} {what}; the top "
          f"{len(profile['top'])}:\n")
    print("| kernel | calls / step | us / step | share |\n|---|---|---|---|")
    for k in profile["top"]:
        print(f"| `{k['kernel'][:80]}` | {k['calls']:g} | {k['us']:,.0f} | {k['share']:.0%} |")


# ---- main ------------------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-30b-a3b", help="a Qwen3-MoE preset or config directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--lengths", type=int, nargs=2, default=[100, 1024], help="workload: prompt and output "
                        "lengths uniform in [LOW, HIGH]")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--new-tokens", type=int, default=64, help=f"HF comparison: tokens after {PROMPT_LEN}")
    parser.add_argument("--context", type=int, default=192, help="decode sweep: tokens a row attends over")
    parser.add_argument("--profile-batch", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20, help="decode sweep: timed steps per batch size")
    parser.add_argument("--decode-only", action="store_true", help="only the decode sweep (d) and profile (e)")
    parser.add_argument("--routing-ab", action="store_true", help="(d) also with the routing by PyTorch ops (GPU)")
    parser.add_argument("--profile-workload", action="store_true", help="(b) a third time, under the profiler")
    parser.add_argument("--routing-return", action="store_true", help="only (f): the workload with and without "
                        "returning every request's routed experts")
    return parse_with_quick(parser, QUICK)


def measure(args: argparse.Namespace, results: dict) -> None:
    """Run (a)-(e), printing as it goes; every figure also goes into `results`."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    config, _ = resolve_model(args.model)
    if not config.is_moe:
        raise ValueError(f"--model: {args.model} has no mixture-of-experts layers")
    results.update(date=str(datetime.date.today()), command=f"python {' '.join(sys.argv)}",
                   device=torch.cuda.get_device_name(device) if cuda else platform.processor() or "CPU",
                   torch=torch.__version__, model=args.model)
    bw = results["copy_bytes_per_s"] = copy_bandwidth(2 << 30 if cuda else 64 << 20, args.device)
    if cuda:
        torch.cuda.empty_cache()
    print(f"## MoE throughput ({results['date']}, {results['device']}, torch {torch.__version__})")
    print(f"command: {results['command']}")
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (read + write)\n")

    t0 = time.perf_counter()
    model = build_model(args.model, device=device, dtype="bfloat16", seed=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"### {args.model}: {weight_bytes / 1e9:.2f} GB of weights, {config.num_experts} experts "
          f"({config.num_experts_per_tok} per token) in {len(model.moe_blocks)} of {config.num_hidden_layers} "
          f"layers, built in {time.perf_counter() - t0:.1f} s\n")

    if not (args.decode_only or args.routing_return):
        hf_runs = hf_part(model, args, results, device)
    t0 = time.perf_counter()
    engine = Engine(model, EngineConfig(device=args.device, num_pages=0 if cuda else 4096, page_size=16,
                                        max_running_requests=max(256, *args.batches), max_prefill_tokens=8192,
                                        enable_return_routed_experts=args.routing_return))
    print(f"engine start-up (pool of {engine.pool.num_pages} pages, graphs): {time.perf_counter() - t0:.1f} s; "
          f"CUDA graphs {bool(engine.runner.graphs)}, fused kernels {model.fused is not None}\n")
    with frozen_heap():  # (no full pass of the collector, every thread held, while timed)
        if args.routing_return:
            routing_return_part(engine, config, args, results)
        else:
            if not args.decode_only:
                workload_part(engine, config, args, results, hf_runs)
            decode_part(engine, model, args, results, device)
            print_tables(results, args, config.num_experts, bw)
    engine.shutdown()


def hf_part(model, args, results: dict, device) -> dict:
    """(a) Hugging Face first: its twin holds no weights of its own, but its activations and KV must be gone before
    the engine sizes its pool."""
    hf = hf_twin(model)
    hf_generate(hf, 1, 2, device)  # warm-up (cuBLAS handles, allocator)
    hf_runs = {b: hf_generate(hf, b, args.new_tokens, device) for b in args.batches}
    hf_tok_s = results["hf_tok_s"] = {b: tok_s for b, (tok_s, _) in hf_runs.items()}
    results["hf_experts"] = getattr(hf.config, "_experts_implementation", None) or "eager"
    print(f"(a) HF generate, {PROMPT_LEN} in, {args.new_tokens} out, greedy (its experts: {results['hf_experts']}): "
          + ", ".join(f"batch {b} {v:,.1f}" for b, v in hf_tok_s.items()) + " tok/s\n")
    del hf
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return hf_runs


def warmed_workload(engine, config, args, routed: bool = False):
    """The workload's (prompts, outputs), after a run of a quarter of it with short outputs through `engine`."""
    prompts, outputs = workload(args.num_seqs, vocab_size=min(10000, config.vocab_size), lengths=args.lengths)
    warm = max(1, len(prompts) // 4)
    asyncio.run(run_workload(engine, prompts[:warm], [min(n, 32) for n in outputs[:warm]], routed))
    return prompts, outputs


def workload_part(engine, config, args, results: dict, hf_runs: dict) -> None:
    """(b) the workload and (c) HF's jobs through the engine."""
    hf_tok_s = results["hf_tok_s"]

    # (b) the workload, after a warm-up (Triton compiles a kernel per new constexpr signature)
    prompts, outputs = warmed_workload(engine, config, args)
    asyncio.run(engine.flush_cache())  # the timed run must prefill its prompts again
    before = asyncio.run(engine.get_stats())
    tok_s = results["workload_tok_s"] = asyncio.run(run_workload(engine, prompts, outputs))
    steps = results["workload_steps"] = asyncio.run(engine.get_stats()).num_steps - before.num_steps
    hf_best = max(hf_tok_s.values())
    results["workload_over_hf_best"] = tok_s / hf_best
    bound = results["workload_bound_tok_s"] = bandwidth_bound(prompts, outputs, engine.model,
                                                               results["copy_bytes_per_s"])
    print(f"(b) {args.num_seqs} sequences, in/out uniform {args.lengths}: **{tok_s:,.0f} output tok/s** "
          f"({steps} steps); HF generate's best (batch {max(hf_tok_s, key=hf_tok_s.get)}): {hf_best:,.1f} tok/s; "
          f"tandem / HF = **{tok_s / hf_best:.1f}x**")
    print(f"    the workload's bandwidth bound (weights, expected experts and running KV each step, at the copy's "
          f"bandwidth): {bound:,.0f} tok/s = {bound / hf_best:.1f}x HF; measured {tok_s / bound:.0%} of it\n")
    if args.profile_workload and engine.runner.device.type == "cuda":
        asyncio.run(engine.flush_cache())
        profile_workload(engine, prompts, outputs)
        print()

    # (c) the same jobs through the engine
    jobs = {b: asyncio.run(engine_job(engine, b, args.new_tokens)) for b in args.batches}
    results["engine_job_tok_s"] = {b: tok_s for b, (tok_s, _) in jobs.items()}
    # the same model on both sides: greedy first tokens agree (up to bf16 near-ties of random weights)
    same = [a == b for batch in args.batches for a, b in zip(jobs[batch][1], hf_runs[batch][1], strict=True)]
    results["first_token_agreement"] = sum(same) / len(same)
    print(f"first generated token equal to HF's in {sum(same)} of {len(same)} rows of the jobs\n")


def routing_return_part(engine, config, args, results: dict) -> None:
    """(f) the workload of (b) without and with every request returning its routed experts, twice each in turn."""
    prompts, outputs = warmed_workload(engine, config, args, routed=True)
    runs = results["routing_return_tok_s"] = {"without": [], "with": []}
    for _ in range(2):
        for routed in (False, True):
            asyncio.run(engine.flush_cache())  # (each run prefills its prompts again)
            runs["with" if routed else "without"].append(asyncio.run(run_workload(engine, prompts, outputs, routed)))
    without, with_ = (sum(runs[k]) / 2 for k in ("without", "with"))
    print(f"(f) {args.num_seqs} sequences, in/out uniform {args.lengths}, output tok/s: without the routed experts "
          f"{', '.join(f'{v:,.0f}' for v in runs['without'])}; with every request's "
          f"{', '.join(f'{v:,.0f}' for v in runs['with'])}: **{with_ / without:.3f}x** (means)")


def decode_part(engine, model, args, results: dict, device) -> None:
    """(d) the decode sweep and (e) the profile of one step."""
    gen = torch.Generator().manual_seed(0)
    sweep = results["decode"] = []
    width = cdiv(args.context, engine.pool.page_size)  # the block table's columns in use (for the eager runs)
    with torch.inference_mode():
        for batch in args.batches:
            step = sweep_step(engine, batch, args.context, gen)
            sec = seconds_per_call(step, args.iters, device)
            touched = experts_touched(model, lambda b=batch: engine.runner._forward_decode(b, width))
            read = step_bytes(model, batch, args.context, touched)
            torch_routing = None
            if args.routing_ab and device.type == "cuda":
                torch_routing = torch_routing_step_seconds(engine, batch, args.context, args.iters)
                print(f"(d) batch {batch}: {sec * 1e3:.2f} ms a step; routing by PyTorch ops: "
                      f"{torch_routing * 1e3:.2f} ms")
            expected = expected_experts(batch, model.config.num_experts, model.config.num_experts_per_tok)
            sweep.append({"batch": batch, "step_s": sec, "tok_s": batch / sec, "bytes": read,
                          "expected_experts": expected, "torch_routing_step_s": torch_routing,
                          "experts_touched": touched, "bytes_per_s": sum(read.values()) / sec})
        kernels, kernel_us, launches = top_kernels(sweep_step(engine, args.profile_batch, args.context, gen), device)
    results["profile"] = {"batch": args.profile_batch, "kernel_us_per_step": kernel_us, "top": kernels,
                          "launches_per_step": launches}


def main() -> None:
    args = parse_args()
    results: dict = {}
    try:
        measure(args, results)
    finally:  # what was measured, also when a later part failed
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
            print(f"\nresults written to {args.out}")


if __name__ == "__main__":
    main()
