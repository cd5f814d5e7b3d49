"""Engine throughput on a GPU, with its references measured in the same run.

    python benchmarks/engine_throughput.py [--models qwen3-0.6b qwen3-8b] [--hf] [--num-seqs 256]

(a) nano-vllm's workload: `--num-seqs` sequences, prompt and output lengths uniform in [100, 1024],
    ignore_eos, random bf16 weights: output tokens per second through `Engine.generate`.
(b) decode sweep at context 1024, batch 1 / 64 / 256: one decode step (the captured graph) timed with CUDA
    events; achieved bandwidth = (weight bytes + KV bytes read) / step time, against a device-to-device copy
    measured in the same run.
    With `--small-ab`, each batch of at most `small_linear.MAX_ROWS` rows (which run through the few-row kernels,
    `EngineConfig.small_batch_kernels`) is timed again with its projections as plain matrix multiplies (the
    model's `_forward_fused`, a graph captured for it), the same run's A/B of the few-row fusions; and up to 8
    rows, with the few-row kernels' tensor-core tiles and with their vector tiles (`small_linear.VECTOR_ROWS`);
    with q/k norm, RoPE and the KV write in the q/k/v projection, not in decode attention (`Fresh`); and with the
    vector tiles' programs of 2 and 8 warps.
    `--profile-batch B`: the top kernels of one decode step at batch B (torch.profiler).
    `--profile-workload`: a third run of (a) under torch.profiler: the share of its wall time in which the GPU ran
    a kernel (the union of the kernels' intervals), and its top kernels: is the workload bound by the device?
(c) with `--hf`: workload (a) through Hugging Face `generate` (all sequences in one left-padded batch, greedy,
    max_new_tokens = the longest output; only each sequence's requested tokens count), and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import random
import sys
import time
from collections.abc import Callable

import torch

from tandem.config import PRESETS, EngineConfig
from tandem.distributed.parallel import cdiv
from tandem.engine.engine import Engine
from tandem.kernels import decode_attention, small_linear
from tandem.run.heap import frozen_heap
from tandem.types import SamplingParams


def parse_with_quick(parser, quick: dict):
    """Parse the command line, adding `--quick` (and `--out FILE`): the sizes in `quick` as defaults, unless a
    size is given explicitly."""
    parser.add_argument("--quick", action="store_true", help=f"small sizes: {quick}")
    parser.add_argument("--out", help="also write the results to this JSON file")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args()
    return args


def seconds_per_call(fn, iters: int, device: torch.device | str = "cuda", warmup: int = 3) -> float:
    """Seconds one call of `fn` takes, after `warmup` calls: timed with CUDA events on a GPU, the host clock
    elsewhere."""
    for _ in range(warmup):
        fn()
    if torch.device(device).type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def copy_bandwidth(num_bytes: int = 2 << 30, device: str = "cuda") -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / seconds_per_call(lambda: dst.copy_(src), 10, device)  # read + write


def workload(num_seqs: int, seed: int = 0, vocab_size: int = 10000, lengths: tuple[int, int] = (100, 1024)):
    """nano-vllm's: prompt and output lengths uniform in `lengths`, prompt ids uniform below `vocab_size`."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(num_seqs)]
    outputs = [rng.randint(*lengths) for _ in range(num_seqs)]
    return prompts, outputs


async def run_workload(engine: Engine, prompts, outputs, routed: bool = False) -> float:
    """Output tokens per second of the workload (`routed`: every request returns its routed experts)."""
    params = [SamplingParams(max_new_tokens=n, temperature=0.6, ignore_eos=True) for n in outputs]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[engine.generate(p, sp, return_routed_experts=routed)
                                  for p, sp in zip(prompts, params, strict=True)])
    elapsed = time.perf_counter() - t0
    assert [len(o.output_ids) for o in outs] == outputs
    return sum(outputs) / elapsed


def decode_step(engine: Engine, batch: int, context: int = 1024):
    """Fill the runner's decode buffers with a batch whose every row attends over `context` positions; return one
    step of it: the captured graph's replay, or the eager forward where there is no graph (call it under
    `torch.inference_mode`)."""
    runner, pool = engine.runner, engine.pool
    P = pool.page_size
    pages_per_row = cdiv(context, P)
    assert batch * pages_per_row <= pool.num_pages, "KV pool too small for the sweep"
    table = torch.arange(batch * pages_per_row, dtype=torch.int32).view(batch, pages_per_row)
    inputs = runner.decode_in.views(batch)
    runner.block_table_BP[:batch, :pages_per_row].copy_(table)
    inputs["seq_lens"].fill_(context)
    inputs["positions"].fill_(context - 1)
    inputs["slots"].copy_(table[:, -1].long() * P + (context - 1) % P)
    if batch in runner.graphs:
        return runner.graphs[batch][0].replay
    return lambda: runner._forward_decode(batch, pages_per_row)


def decode_step_seconds(engine: Engine, batch: int, context: int = 1024, iters: int = 20) -> float:
    """Time one decode step (`decode_step`) of a batch whose every row attends over `context` positions."""
    with torch.inference_mode():
        return seconds_per_call(decode_step(engine, batch, context), iters, engine.runner.device)


def loop_step_seconds(engine: Engine, batch: int, context: int = 1024, tokens: int = 256) -> tuple[float, dict]:
    """A decode step through the engine's loop (scheduling, the step's inputs, the graph, sampling, the outputs), where
    `decode_step_seconds` times the graph alone: `batch` greedy requests whose contexts average `context`, timed as
    the difference of two runs `tokens` apart in length (their prefills, of prompts of their own, cancel) over
    `tokens`; and the longer run's host time per step, as the engine counts it (`EngineStats`: busy, and in it
    schedule, prepare, forward + the wait for the step before, postprocess), which says whether the host keeps up."""
    def run(new_tokens: int, seed: int) -> float:
        g = torch.Generator().manual_seed(seed)
        vocab = engine.model_config.vocab_size
        prompts = [torch.randint(3, vocab, (context - tokens // 2,), generator=g).tolist() for _ in range(batch)]
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)

        async def go():
            await asyncio.gather(*(engine.generate(ids, sampling) for ids in prompts))
        start = time.perf_counter()
        asyncio.run(go())
        return time.perf_counter() - start
    run(tokens + 32, 1)  # (warm: this batch's graphs and kernels)
    before = asyncio.run(engine.get_stats())
    long = run(tokens + 32, 2)
    after = asyncio.run(engine.get_stats())
    steps = max(1, after.num_steps - before.num_steps)
    host = {k: (getattr(after, f"{k}_seconds") - getattr(before, f"{k}_seconds")) / steps
            for k in ("busy", "schedule", "prepare", "forward", "postprocess")}
    return (long - run(32, 3)) / tokens, host


def swept_tilings(path: str, cfg) -> Callable:
    """A stand-in for `small_linear.default_blocks` that returns the best tilings `small_linear_blocks.py --out
    path` found for this model's projections: at R rows, those of the fewest swept rows at least R (below the
    fewest swept, only at VECTOR_ROWS rows and above); the default's tiling elsewhere, and without a split's counts."""
    with open(path) as f:
        swept = json.load(f)
    E, H, K, D, inter = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.intermediate_size)
    keys = {"qkv": ((H + 2 * K) * D, E, True, False), "o": (E, H * D, False, False),
            "gate_up": (inter, E, False, True), "down": (E, inter, False, False)}  # (N, E, heads, paired)
    table = {int(rows): {keys[p["projection"]]: small_linear.Blocks(**p["best"]) for p in sweep["projections"]}
             for rows, sweep in swept["rows"].items()}
    default = small_linear.default_blocks

    def tuned(N, E, device, split=True, heads=None, itemsize=2, rows=small_linear.MAX_ROWS, paired=False):
        covering = [r for r in sorted(table) if r >= rows]
        if split and covering and (rows > small_linear.VECTOR_ROWS or covering[0] == rows):
            found = table[covering[0]].get((N, E, heads is not None, paired))
            if found is not None:
                return found
        return default(N, E, device, split, heads, itemsize, rows, paired)

    return tuned


def variant_step_seconds(engine: Engine, batch: int, fused: bool = True, vector_rows: int | None = None,
                         fresh: bool = True, vector_warps: int | None = None, tilings: Callable | None = None,
                         context: int = 1024, iters: int = 20) -> float:
    """`decode_step_seconds` of a variant, in a graph of its own captured here: without the few-row fusions
    (`fused=False`), with vector tiles up to `vector_rows` rows (`small_linear.VECTOR_ROWS`), or with q/k norm,
    RoPE and the KV write in the q/k/v projection rather than in attention (`fresh=False`), or with vector tiles of
    `vector_warps` warps (`small_linear.VECTOR_WARPS`), or with the projections' tilings `tilings` chooses (a
    stand-in for `small_linear.default_blocks`, `swept_tilings`)."""
    from tandem.model.attention import BlockTableDecode

    model, small, default_rows = engine.model, engine.model.small, small_linear.VECTOR_ROWS
    takes_fresh, default_warps = BlockTableDecode.takes_fresh, small_linear.VECTOR_WARPS
    default_blocks = small_linear.default_blocks
    small_linear.VECTOR_WARPS = vector_warps or default_warps
    small_linear.default_blocks = tilings or default_blocks
    decode_step(engine, batch, context)  # (fills the buffers)
    model.small = small if fused else None
    small_linear.VECTOR_ROWS = default_rows if vector_rows is None else vector_rows
    if not fresh:
        BlockTableDecode.takes_fresh = lambda self, dtype, head_dim: False
    try:
        with torch.inference_mode():
            engine.runner._forward_decode(batch)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                engine.runner._forward_decode(batch)
            seconds = seconds_per_call(graph.replay, iters, engine.runner.device)
        del graph
        return seconds
    finally:
        model.small, small_linear.VECTOR_ROWS, BlockTableDecode.takes_fresh = small, default_rows, takes_fresh
        small_linear.VECTOR_WARPS, small_linear.default_blocks = default_warps, default_blocks


def hf_tokens_per_s(model_name: str, prompts, outputs) -> float:
    import transformers

    cfg = PRESETS[model_name]
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.to_hf_dict().items()
                                         if k not in ("architectures", "torch_dtype")})
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(outputs), min_new_tokens=max(outputs),
                       do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return sum(outputs) / elapsed


def profile_workload(engine: Engine, prompts, outputs, top: int = 16) -> None:
    """Run workload (a) under torch.profiler and print how busy the GPU was, and the kernels it ran longest."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        tok_s = asyncio.run(run_workload(engine, prompts, outputs))
        wall = time.perf_counter() - t0
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    busy, end, last, gaps = 0.0, float("-inf"), None, []  # the union of the kernels' [start, end) intervals, in us
    totals: dict[str, list] = {}  # name -> [calls, us, us past every kernel that started before it]
    for e in kernels:
        start, stop = e.time_range.start, e.time_range.end
        if last is not None and start > end:
            gaps.append((start - end, start, last, e.name[:60]))
        alone = max(0.0, stop - max(start, end))
        busy += alone
        row = totals.setdefault(e.name[:80], [0, 0.0, 0.0])
        row[0] += 1
        row[1] += e.time_range.elapsed_us()
        row[2] += alone
        if stop > end:
            end, last = stop, e.name[:60]
    print(f"\n(a) under the profiler: {tok_s:,.0f} output tok/s, {wall:.2f} s; a kernel ran on the GPU "
          f"{busy / 1e6:.2f} s of it ({busy / 1e6 / wall:.0%}), {len(kernels):,} kernels")
    print_gaps(gaps, kernels[0].time_range.start if kernels else 0.0, end)
    print("| kernel | calls | s | s past the kernels that started before it (the busy time's share) |\n"
          "|---|---|---|---|")
    for name, (calls, us, alone) in sorted(totals.items(), key=lambda kv: -kv[1][2])[:top]:
        print(f"| `{name}` | {calls:,} | {us / 1e6:.3f} | {alone / 1e6:.3f} ({alone / busy:.0%}) |")


def print_gaps(gaps, first: float, last: float, top: int = 12) -> None:
    """Where the GPU sat idle between the first kernel and the last (`gaps`: (us, start, kernel before, kernel
    after)): the idle time by the gaps' length, by tenth of the run, and the kernel pairs that held the most."""
    edges = [2, 10, 100, 1_000, 10_000, float("inf")]
    print(f"idle between kernels: {sum(g[0] for g in gaps) / 1e6:.3f} s in {len(gaps):,} gaps\n"
          "| gap length us | gaps | ms |\n|---|---|---|")
    low = 0
    for high in edges:
        chosen = [g[0] for g in gaps if low <= g[0] < high]
        print(f"| {low:,}-{high:,} | {len(chosen):,} | {sum(chosen) / 1e3:.1f} |")
        low = high
    tenths = [0.0] * 10
    for us, start, *_ in gaps:
        tenths[min(9, int(10 * (start - first) / max(last - first, 1.0)))] += us
    print("idle by tenth of the run, ms: " + " / ".join(f"{t / 1e3:.0f}" for t in tenths))
    pairs: dict[tuple[str, str], list] = {}
    for us, _, before, after in gaps:
        if us >= 10:
            row = pairs.setdefault((before, after), [0, 0.0])
            row[0] += 1
            row[1] += us
    print("| gaps of 10 us or more: kernel before -> kernel after | gaps | ms |\n|---|---|---|")
    for (before, after), (n, us) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| `{before}` -> `{after}` | {n:,} | {us / 1e3:.1f} |")
    print()


def bandwidth_bound(prompts, outputs, weight_bytes: int, kv_per_token: int, bandwidth: float) -> float:
    """Output tokens a second that the workload's bytes allow: every decode step reads the weights and the KV of
    every sequence still running (all admitted at once, as the pool holds them all), at `bandwidth` (the copy's, as
    the decode sweep's "of copy BW" compares); step s runs the sequences with more than s outputs. Prefill's
    compute and the KV writes are left out, so no run can beat it."""
    seconds = 0.0
    for s in range(max(outputs)):
        context = sum(len(p) + s for p, n in zip(prompts, outputs, strict=True) if n > s)
        seconds += (weight_bytes + context * kv_per_token) / bandwidth
    return sum(outputs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b"])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--hf", action="store_true")
    parser.add_argument("--small-ab", action="store_true", help="time batches of few rows without their fusions too")
    parser.add_argument("--profile-batch", type=int, help="the top kernels of a decode step at this batch")
    parser.add_argument("--skip-workload", action="store_true", help="only the decode sweep")
    parser.add_argument("--profile-workload", action="store_true", help="(a) a third time, under the profiler")
    parser.add_argument("--attention-programs-per-sm", type=int, help="decode attention's split choice (an A/B): "
                        f"programs per SM (default {decode_attention.PROGRAMS_PER_SM})")
    parser.add_argument("--attention-balance", type=int, help="decode attention's balanced split (an A/B): programs "
                        f"per SM (default {decode_attention.BALANCED_PROGRAMS_PER_SM}; 0: each context cut into the "
                        "graph's split count)")
    parser.add_argument("--small-tilings", help="a column more: batches of few rows with the projections' tilings "
                        "that `small_linear_blocks.py --out FILE` found best (FILE)")
    parser.add_argument("--attention-max-split", type=int, help="decode attention's longest balanced split, tokens "
                        f"(default {decode_attention.MAX_BALANCED_SPLIT})")
    parser.add_argument("--small-rowwise", type=int, help="rows up to which the few-row projections sum their "
                        f"products a row at a time (an A/B; default {small_linear.ROWWISE_ROWS}, 0: never)")
    parser.add_argument("--small-vector-rows", type=int, help="rows up to which the few-row projections take "
                        f"vector tiles (default {small_linear.VECTOR_ROWS}; an A/B)")
    parser.add_argument("--small-early-residual", type=int, choices=(0, 1), help="whether the few-row projections "
                        "read the residual before their dependent wait (an A/B; default "
                        f"{int(small_linear.EARLY_RESIDUAL)})")
    parser.add_argument("--attention-loop-saves", type=int, help="decode attention's first stage loops over work items "
                        f"where that launches this many times fewer programs (an A/B; default "
                        f"{decode_attention.LOOP_SAVES})")
    args = parser.parse_args()
    if args.attention_loop_saves:
        decode_attention.LOOP_SAVES = args.attention_loop_saves
    if args.small_rowwise is not None:
        small_linear.ROWWISE_ROWS = args.small_rowwise
    if args.small_vector_rows is not None:
        small_linear.VECTOR_ROWS = args.small_vector_rows
    if args.small_early_residual is not None:
        small_linear.EARLY_RESIDUAL = bool(args.small_early_residual)
    if args.attention_programs_per_sm:
        decode_attention.PROGRAMS_PER_SM = args.attention_programs_per_sm
    if args.attention_balance is not None:
        decode_attention.BALANCED_PROGRAMS_PER_SM = args.attention_balance
    if args.attention_max_split:
        decode_attention.MAX_BALANCED_SPLIT = args.attention_max_split
    bw = copy_bandwidth()
    print(f"## engine throughput ({datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__})")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s; decode attention: {decode_attention.PROGRAMS_PER_SM} "
          f"programs per SM, splits balanced over {decode_attention.BALANCED_PROGRAMS_PER_SM} programs per SM of at "
          f"most {decode_attention.MAX_BALANCED_SPLIT} tokens, looping over items where that launches "
          f"{decode_attention.LOOP_SAVES}x fewer programs; "
          f"few-row vector tiles up to {small_linear.VECTOR_ROWS} rows, their products a row at a time up to "
          f"{small_linear.ROWWISE_ROWS}; the residual read "
          f"{'before' if small_linear.EARLY_RESIDUAL else 'after'} "
          "their dependent wait\n")
    prompts, outputs = workload(args.num_seqs)
    for name in args.models:
        cfg = PRESETS[name]
        t0 = time.perf_counter()
        engine = Engine(name, EngineConfig(device="cuda", num_pages=0, page_size=16, max_running_requests=256,
                                           max_prefill_tokens=8192), dtype="bfloat16")
        startup = time.perf_counter() - t0
        heap = contextlib.ExitStack()
        heap.enter_context(frozen_heap())  # (no full pass of the heap, every thread held, while timed)
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
        print(f"### {name}: {weight_bytes / 1e9:.2f} GB of weights, {kv_per_token // 1024} KiB KV per token, "
              f"{engine.pool.num_pages} pages, start-up (weights, pool, graphs) {startup:.1f} s\n")
        # warm-up on the same workload: Triton compiles a kernel per new constexpr signature (batch-dependent split
        # counts, block sizes), which must not be timed
        if not args.skip_workload:
            asyncio.run(run_workload(engine, prompts, outputs))
            asyncio.run(engine.flush_cache())  # the timed run must prefill its prompts again
            before = asyncio.run(engine.get_stats())
            tok_s = asyncio.run(run_workload(engine, prompts, outputs))
            after = asyncio.run(engine.get_stats())
            spent = {k: getattr(after, f"{k}_seconds") - getattr(before, f"{k}_seconds")
                     for k in ("busy", "schedule", "prepare", "forward", "postprocess")}
            steps = after.num_steps - before.num_steps
            print(f"(a) {args.num_seqs} sequences, in/out uniform [100, 1024]: {tok_s:,.0f} output tok/s; "
                  f"{steps} steps, " + ", ".join(f"{k} {1e3 * v / steps:.2f} ms" for k, v in spent.items())
                  + " per step")
            bound = bandwidth_bound(prompts, outputs, weight_bytes, kv_per_token, bw)
            print(f"    the workload's bandwidth bound (weights and running KV each step, at the copy's bandwidth): "
                  f"{bound:,.0f} tok/s; measured {tok_s / bound:.0%} of it")
            if args.profile_workload:
                asyncio.run(engine.flush_cache())
                profile_workload(engine, prompts, outputs)
        print("\n| batch | step ms | tok/s | bytes/step GB | achieved GB/s | of copy BW | without the few-row "
              "fusions: step ms | few-row, tensor-core / vector tiles: step ms | q/k norm and RoPE in the projection, "
              "not attention: step ms | vector tiles of 2 / 8 warps: step ms | the swept tilings (--small-tilings): "
              "step ms | through the engine's loop: step ms (tok/s) |\n" + "|---" * 12 + "|")
        tilings = args.small_tilings and swept_tilings(args.small_tilings, cfg)
        hosts = []
        for batch in args.batches:
            loop, host = loop_step_seconds(engine, batch)
            hosts.append((batch, host))
            sec = decode_step_seconds(engine, batch)
            read = weight_bytes + batch * 1024 * kv_per_token
            ab = args.small_ab and engine.model.small and batch <= engine.model.small.MAX_ROWS
            unfused = f"{variant_step_seconds(engine, batch, fused=False) * 1e3:.2f}" if ab else "-"
            tiles = "-"
            if ab and batch <= 8:
                tiles = (f"{variant_step_seconds(engine, batch, vector_rows=0) * 1e3:.2f} / "
                         f"{variant_step_seconds(engine, batch, vector_rows=batch) * 1e3:.2f}")
            unfresh = f"{variant_step_seconds(engine, batch, fresh=False) * 1e3:.2f}" if ab else "-"
            warps = "-"
            if ab and batch <= small_linear.VECTOR_ROWS:
                warps = " / ".join(f"{variant_step_seconds(engine, batch, vector_warps=w) * 1e3:.2f}" for w in (2, 8))
            swept = "-"
            if tilings and engine.model.small and batch <= small_linear.MAX_ROWS:
                swept = f"{variant_step_seconds(engine, batch, tilings=tilings) * 1e3:.2f}"
            print(f"| {batch} | {sec * 1e3:.2f} | {batch / sec:,.0f} | {read / 1e9:.2f} | {read / sec / 1e9:,.0f} | "
                  f"{read / sec / bw:.0%} | {unfused} | {tiles} | {unfresh} | {warps} | {swept} | "
                  f"{loop * 1e3:.2f} ({batch / loop:,.0f}) |")
        print("\nthe engine's loop, host time a step (ms): " + "; ".join(
            f"batch {b}: " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in host.items()) for b, host in hosts))
        if args.profile_batch:
            from moe_throughput import top_kernels

            with torch.inference_mode():
                rows, total, _ = top_kernels(decode_step(engine, args.profile_batch), engine.runner.device, top=16)
            print(f"\none decode step at batch {args.profile_batch}, context 1024: {total / 1e3:.3f} ms of kernels\n"
                  "| kernel | calls / step | us / step | share |\n|---|---|---|---|")
            for k in rows:
                print(f"| `{k['kernel'][:80]}` | {k['calls']:g} | {k['us']:,.1f} | {k['share']:.0%} |")
        heap.close()
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()
        if args.hf:
            hf = hf_tokens_per_s(name, prompts, outputs)
            print(f"\n(c) Hugging Face generate, same workload: {hf:,.0f} output tok/s; "
                  f"tandem / HF = {tok_s / hf:.1f}x")
        print()


if __name__ == "__main__":
    main()
