"""Prefill/decode disaggregation against unified serving on the same hardware, under long prompts arriving while
many requests decode (the interference disaggregation removes). Every setup and reference in one run.

    python benchmarks/disaggregation.py [--model qwen3-0.6b] [--gpus 1] [--out disagg.json]
    python benchmarks/disaggregation.py --model tiny --device cpu --quick      (a smoke run on a CPU)
    python benchmarks/disaggregation.py --transfer-only [--out transfer.json]  (only (b)'s KV transfer, below)

Setups: each server a process of its own, spawned here (an `Engine` served by `ServerThread`, as `EngineProcess`
serves one, plus the token clock below), the client always through a router in this process (so every setup pays
the same hop), every server with the same engine config, its KV pool holding the whole workload:
  (a) one unified server (the router in replica mode, one replica);
  (b) a prefill and a decode server (`EngineConfig.role`), the router in prefill/decode mode; on one GPU both
      processes share it, with `--gpus 2` each has one;
  (c) `--gpus 2` only: two unified servers as replicas, one a GPU: (b)'s hardware, so on two GPUs (b) is compared
      with (c). On one GPU there is no (c): (a) already holds all of the hardware.

Workload (seeded, `SIZES`): `decoders` requests (`decode_prompt` tokens in, `decode_output` out, ignore_eos) start
together; after `delay` s, `long` prompts (`long_min`-`long_max` tokens, `long_output` out) arrive at `rate` a
second. A smaller pass of the same shapes warms the servers up first (kernels compile), then every cache is flushed.
`max_prefill_tokens` is every engine's prefill budget a step (how long a step with a long prompt's chunk takes).

Metrics:
- Decode inter-token latency (ITL), p50 and p99. The servers do not stream, so each server process records when
  each token of each request reaches its host (a wrapper around `Scheduler.resolve`, installed before its engine
  starts): the moment a streaming server would send it; on a decode server the first token's moment is its import,
  the KV arrived and verified. The samples: the gaps between consecutive tokens of each decoder on the server that
  answers it, while long prompts are in flight (from the first one's arrival to the last one's answer); the gaps
  outside that window are the reference. (`time.monotonic` is one clock for all the machine's processes.)
- Output throughput: all output tokens / the time from the first request to the last answer.
- Long prompts' time to first token (TTFT): when the answering server had it, minus when the client sent the prompt.
- KV transfer (b only), on the idle servers after the workload, of a `transfer_tokens` prompt the prefill server
  computed once before (so each timed call costs it about one token of compute): (i) export as bytes, a
  `/pd/prefill` from here: the prefill server reads the KV out of its pool, checksums and sends it; (ii) end to
  end, a `/generate` with `bootstrap` to the decode server, its cache flushed: the transfer as the decode server
  chooses it (offered and chosen kinds are printed), its verification, the write into its pool and one decode
  step; (iii) the transfer itself, as the servers time it in those calls (`/pd/transfers`): (iv) the prefill
  server's export (pages gathered out of its pool, checksummed, shared or serialised) plus (v) the decode
  server's import (from the answer in hand to the pages written in its pool, device-synchronised: mapped or
  received, copied, verified, written; by reference: the one pass over the mapped pages, checked, run as the
  answer lands into pages set aside when the decode server sent the prompt, else by the engine's thread). By
  reference also (vi), after (v), the request queued in the engine with the pages written, and (vii) the whole
  way from the prefill server starting its export to the decode server's checksums compared, on the host's one
  monotonic clock: (iii) plus what it leaves out (the prefill engine's output to its server, the answer's way).
  By reference the prefill server answers with the pages before its checksum pass is done (the sums follow), so
  that pass runs during the answer's way, which (iii) does not count: the target is then judged on (vii).
  Against a device-to-device copy in the same run (on a CPU a memcpy), traffic against traffic: a transfer of B
  bytes of KV reads and writes each once, so its share is `copy_time(B) / time`, where `copy_time(B)` is the time the
  copy takes to move B bytes (to read B and write B: 2 B / the copy's read + write bandwidth); a transfer as fast as
  a plain copy of the same bytes is 100%. The old convention (B / time against the copy's read + write bandwidth,
  up to 2026-12-02) is half of it, printed beside it. `--transfer-only` runs only this, on (b)'s servers, with no
  workload before it, and before the servers the kernel alone (`kv_copy_bench.py`: device times of the fused pass,
  the checksum pass and the plain copy) so the host's part shows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import gc
import json
import multiprocessing as mp
import os
import platform
import random
import signal
import statistics
import sys
import time
from collections import defaultdict

import aiohttp
import torch
from disagg_transfer import call, kv_transfer, report_transfer
from engine_throughput import copy_bandwidth, parse_with_quick
from kv_copy_bench import kernel_times
from kv_copy_bench import report as report_kernel

from tandem.config import PRESETS, EngineConfig
from tandem.distributed.parallel import cdiv
from tandem.run.heap import freeze_heap
from tandem.server.http import ServerThread
from tandem.server.router import build_router_app
from tandem.server.router_config import RouterConfig

SIZES = dict(decoders=64, decode_prompt=128, decode_output=1024, long=16, long_min=2048, long_max=8192, long_output=4,
             rate=8.0, delay=0.5, max_prefill_tokens=2048, transfer_tokens=8192)  # (rate: long prompts a second)
QUICK = dict(decoders=8, decode_prompt=32, decode_output=160, long=4, long_min=256, long_max=512, long_output=2,
             rate=4.0, delay=0.3, max_prefill_tokens=256, transfer_tokens=4000)
PAGE = 16


def _serve(model: str, config: EngineConfig, dtype: str, gpu: str | None, conn) -> None:
    """A server process's main: serve `config`'s engine, recording when each token reaches the host, per rid;
    answer "times" (hand over and forget what was recorded) until "stop" or the parent goes away."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us in order
    from tandem.engine.engine import Engine
    from tandem.engine.scheduler import Scheduler

    times: dict[str, list[float]] = defaultdict(list)
    resolve = Scheduler.resolve

    def timed(self, req, *args):
        times[req.rid].append(time.monotonic())
        return resolve(self, req, *args)

    Scheduler.resolve = timed
    try:
        engine = Engine(model, config, dtype=dtype)
        server = ServerThread(engine).start()
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("url", server.url))
    freeze_heap()  # (as an engine's own process does: no full pass of the collector over what is built)
    try:
        while conn.recv() == "times":
            snapshot = dict(times)
            times.clear()
            conn.send(snapshot)
    except EOFError:
        pass
    finally:
        server.stop()
        engine.shutdown()
        gc.unfreeze()  # (what the heap kept goes before the interpreter does: no leak report at its exit)


class Server:
    """One server process (see `_serve`): `wait` until it serves, then `token_times`, `stop`."""

    def __init__(self, model: str, config: EngineConfig, dtype: str, gpu: str | None):
        ctx = mp.get_context("spawn")
        self.role, self.url = config.role, ""
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(model, config, dtype, gpu, child), daemon=True)
        self.process.start()
        child.close()

    def wait(self, timeout_s: float) -> None:
        who = f"{self.role} server pid {self.process.pid}"
        try:
            if not self.conn.poll(timeout_s):
                raise RuntimeError(f"{who}: not serving within {timeout_s:g} s")
            kind, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{who}: exited while starting") from None
        if kind == "error":
            raise RuntimeError(f"{who}: failed to start: {value}")
        self.url = value

    def token_times(self) -> dict[str, list[float]]:
        self.conn.send("times")
        return self.conn.recv()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send("stop")
        self.process.join(30)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(10)


@dataclasses.dataclass(frozen=True)
class Job:
    rid: str
    ids: list[int]
    max_new_tokens: int
    at: float  # seconds after the workload's start
    seed: int
    long: bool


def workload(args, tag: str, seed: int, decode_output: int, num_long: int) -> list[Job]:
    rng, vocab = random.Random(seed), PRESETS[args.model].vocab_size
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]
    jobs = [Job(f"{tag}-dec{i}", ids(args.decode_prompt), decode_output, 0.0, i, False) for i in range(args.decoders)]
    return jobs + [Job(f"{tag}-long{i}", ids(rng.randint(args.long_min, args.long_max)), args.long_output,
                       args.delay + i / args.rate, 1000 + i, True) for i in range(num_long)]


async def run_jobs(http: aiohttp.ClientSession, url: str, jobs: list[Job]) -> dict[str, tuple[float, float, int]]:
    """Each job at its time; rid -> (sent, answered, output tokens)."""
    t0 = time.monotonic()

    async def one(job: Job):
        await asyncio.sleep(max(0.0, t0 + job.at - time.monotonic()))
        sampling = {"max_new_tokens": job.max_new_tokens, "temperature": 0.6, "seed": job.seed, "ignore_eos": True}
        sent = time.monotonic()
        out = json.loads(await call(http, f"{url}/generate", {"rid": job.rid, "input_ids": job.ids,
                                                               "sampling_params": sampling}))
        if (finish := out["meta_info"]["finish_reason"])["type"] != "length":
            raise RuntimeError(f"{job.rid} ended early: {finish}")
        return job.rid, (sent, time.monotonic(), len(out["output_ids"]))

    return dict(await asyncio.gather(*map(one, jobs)))


def summarize(jobs: list[Job], answers: dict, times: dict[str, list[float]]) -> dict:
    """The metrics of a run (`answers`: `run_jobs`'s; `times`: each rid's token times on the server answering it)."""
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")  # nearest rank
    longs, decoders = [j for j in jobs if j.long], [j for j in jobs if not j.long]
    window = (min(answers[j.rid][0] for j in longs), max(answers[j.rid][1] for j in longs))
    inside, outside = [], []
    for j in decoders:
        ts = times[j.rid]
        assert len(ts) == answers[j.rid][2], (j.rid, len(ts), answers[j.rid])  # one record a token
        for a, b in zip(ts, ts[1:], strict=False):
            (inside if window[0] <= b <= window[1] else outside).append(b - a)
    ttft = [times[j.rid][0] - answers[j.rid][0] for j in longs]
    start, end = min(a[0] for a in answers.values()), max(a[1] for a in answers.values())
    return {"itl_p50_ms": 1e3 * pct(inside, 50), "itl_p99_ms": 1e3 * pct(inside, 99), "itl_samples": len(inside),
            "itl_outside_p50_ms": 1e3 * pct(outside, 50), "itl_outside_p99_ms": 1e3 * pct(outside, 99),
            "output_tok_s": sum(a[2] for a in answers.values()) / (end - start), "wall_s": end - start,
            "ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_max_ms": 1e3 * max(ttft),
            "decoding_at_every_arrival": min(answers[j.rid][1] for j in decoders) >= max(answers[j.rid][0]
                                                                                        for j in longs)}


async def measure(servers: list[Server], router_url: str, args) -> dict:
    """Warm up, flush, run the workload; then, with a prefill server, the KV transfer."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900),
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        result = {} if args.transfer_only else await workload_metrics(http, servers, router_url, args)
        prefill, decode = ([s.url for s in servers if s.role == role] for role in ("prefill", "decode"))
        if prefill:
            ids = random.Random(args.seed + 2).choices(range(3, PRESETS[args.model].vocab_size),
                                                       k=args.transfer_tokens)
            result["transfer"] = await kv_transfer(http, prefill[0], decode[0], ids, args.transfer_reps)
        return result


async def workload_metrics(http: aiohttp.ClientSession, servers: list[Server], router_url: str, args) -> dict:
    """Warm up, flush, run the workload: `summarize`'s metrics, and the KV moved if there is a prefill server."""
    warm = workload(args, "warm", args.seed + 1, max(2, args.decode_output // 8), max(2, args.long // 4))
    await run_jobs(http, router_url, warm)
    await call(http, f"{router_url}/flush_cache", {})
    for s in servers:
        s.token_times()  # (forget the warm-up's)
    before = json.loads(await call(http, f"{router_url}/engine_stats"))
    jobs = workload(args, "run", args.seed, args.decode_output, args.long)
    answers = await run_jobs(http, router_url, jobs)
    after = json.loads(await call(http, f"{router_url}/engine_stats"))
    times = {rid: ts for s in servers for rid, ts in s.token_times().items()}
    result = summarize(jobs, answers, times) | {k: after[k] - before[k] for k in ("num_retractions",
                                                                                 "imports_recomputed")}
    if any(s.role == "prefill" for s in servers):
        info = json.loads(await call(http, f"{[s.url for s in servers if s.role == 'prefill'][0]}/pd/info"))
        itemsize = torch.empty(0, dtype=getattr(torch, info["kv_dtype"])).element_size()
        per_token = 2 * info["num_layers"] * info["num_kv_heads"] * info["head_dim"] * itemsize
        result["kv_bytes_moved"] = per_token * sum(len(j.ids) for j in jobs)
    return result


def run_setup(roles: list[tuple[str, str | None]], args, config: EngineConfig, dtype: str) -> dict:
    """Start the servers (`roles`: role and GPU each) and a router in front of them, then `measure`."""
    t0 = time.monotonic()
    servers = [Server(args.model, dataclasses.replace(config, role=role), dtype, gpu) for role, gpu in roles]
    try:
        for s in servers:
            s.wait(args.start_timeout)
        urls = {role: tuple(s.url for s in servers if s.role == role) for role in ("unified", "prefill", "decode")}
        routes = RouterConfig(servers=urls["unified"]) if urls["unified"] else \
            RouterConfig(prefill=urls["prefill"], decode=urls["decode"])
        with ServerThread(app=build_router_app(routes)) as router:
            startup = time.monotonic() - t0
            result = asyncio.run(measure(servers, router.url, args))
    finally:
        for s in sorted(servers, key=lambda s: s.role == "prefill"):  # (a decode server drops its mapping first)
            s.stop()
    return result | {"servers": [f"{role}@{gpu or args.device}" for role, gpu in roles], "startup_s": startup}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gpus", type=int, choices=(1, 2), default=1, help="2: (b) on two GPUs, and (c) (on a CPU: "
                   "(c) too, the servers sharing it)")
    for name, default in SIZES.items():  # (the module docstring says what each is)
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transfer-only", action="store_true", help="only (b)'s KV transfer: no workload, no (a), (c)")
    p.add_argument("--transfer-reps", type=int, default=3, help="the KV transfer's timed repetitions (the median)")
    p.add_argument("--pass-graphs", action="store_true", help="the decode's pass by reference replayed as a CUDA "
                   "graph (engine.kv_pass_graphs)")
    p.add_argument("--doorbells", action=argparse.BooleanOptionalAction, default=True, help="the decode's pass by "
                   "reference queued as the pages mail lands, behind a doorbell the prefill engine rings "
                   "(engine.kv_doorbells; --no-doorbells: launched as the ready mail lands)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    return parse_with_quick(p, QUICK)


def main() -> None:
    args = parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and torch.cuda.device_count() < args.gpus:
        raise ValueError(f"--gpus: {args.gpus} asked, {torch.cuda.device_count()} visible")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = (visible.split(",") if visible else [str(i) for i in range(args.gpus)]) if cuda else [None] * args.gpus
    need = args.decoders * (args.decode_prompt + args.decode_output) + args.long * (args.long_max + args.long_output)
    config = EngineConfig(device="cuda:0" if cuda else "cpu", page_size=PAGE,
                          num_pages=cdiv(need + args.transfer_tokens, PAGE) + 2 * (args.decoders + args.long),
                          max_running_requests=args.decoders + args.long + 2,
                          max_prefill_tokens=args.max_prefill_tokens, kv_pass_graphs=args.pass_graphs,
                          kv_doorbells=args.doorbells)
    results = {"date": str(datetime.date.today()), "command": f"python {' '.join(sys.argv)}",
               "device": torch.cuda.get_device_name() if cuda else platform.processor() or "CPU",
               "torch": torch.__version__, "args": vars(args), "setups": {}}
    results["copy_bytes_per_s"] = copy_bandwidth(2 << 30 if cuda else 256 << 20, "cuda" if cuda else "cpu")
    if cuda and args.transfer_only:
        try:  # (the kernel alone, device time; a failure here must not cost the servers' measurement)
            results["kernel"] = kernel_times(args.model, args.transfer_tokens, PAGE)
        except Exception as e:
            results["kernel"] = {"error": f"{type(e).__name__}: {e}"}
    if cuda:
        torch.cuda.empty_cache()
    setups = {"(a) unified": [("unified", gpus[0])],
              "(b) prefill+decode": [("prefill", gpus[0]), ("decode", gpus[args.gpus - 1])]}
    if args.gpus == 2:
        setups["(c) 2 x unified, replicas"] = [("unified", g) for g in gpus[:2]]
    if args.transfer_only:
        setups = {"(b) prefill+decode": setups["(b) prefill+decode"]}
    try:
        for name, roles in setups.items():
            results["setups"][name] = run_setup(roles, args, config, "bfloat16" if cuda else "float32")
        results["targets"] = targets(results, "(c) 2 x unified, replicas" if args.gpus == 2 else "(a) unified")
        report(results, args)
    finally:  # what was measured, also when a later part failed
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


def targets(results: dict, base_name: str) -> list[dict]:
    """The issue's targets: the transfer against the copy; (b) against `base_name` (not with --transfer-only)."""
    pd = results["setups"]["(b) prefill+decode"]
    t, copy = pd["transfer"], results["copy_bytes_per_s"]
    copy_time = 2 * t["kv_bytes"] / copy  # (the copy's time to read and write the same bytes)
    # (by reference the whole way on one clock, (vii): the prefill's checksum pass runs during the answer's way,
    # which (iii) leaves out, so (iii) alone would flatter it)
    whole = "decode_path_s" in t
    share, e2e = copy_time / t["decode_path_s" if whole else "transfer_s"], copy_time / t["end_to_end_s"]
    rows = [("KV transfer between the two processes (" + ("the whole way: the prefill's KV ready to decode pages "
             "written and checked" if whole else "prefill export + decode import") + "): copy time of the same "
             "bytes / transfer time", "at least 50%", f"{share:.1%} (old convention {share / 2:.1%}; (iii) "
             f"{copy_time / t['transfer_s']:.1%}; {e2e:.1%} end to end)", share >= 0.5)]
    if base_name in results["setups"]:
        base = results["setups"][base_name]
        ratio = pd["output_tok_s"] / base["output_tok_s"]
        rows += [(f"decode ITL p99 under long prompts, (b) against {base_name}", "lower",
                  f"{pd['itl_p99_ms']:.2f} against {base['itl_p99_ms']:.2f} ms", pd["itl_p99_ms"] < base["itl_p99_ms"]),
                 (f"output throughput, (b) against {base_name}", "at most 10% lower",
                  f"{pd['output_tok_s']:,.0f} against {base['output_tok_s']:,.0f} tok/s ({ratio - 1:+.1%})",
                  ratio >= 0.9)]
    return [dict(zip(("target", "wanted", "measured", "met"), row, strict=True)) for row in rows]


def report(results: dict, args) -> None:
    bw, copy = results["copy_bytes_per_s"], "device-to-device copy" if args.device.startswith("cuda") else "memcpy"
    print(f"## disaggregation ({results['date']}, {results['device']}, torch {results['torch']}, {args.model})\n")
    print(f"command: `{results['command']}`; {copy}: {bw / 1e9:,.1f} GB/s (read + write)\n")
    pd = results["setups"]["(b) prefill+decode"]
    if not args.transfer_only:
        print(f"{args.decoders} decoders ({args.decode_prompt} in, {args.decode_output} out) from t=0; {args.long} "
              f"long prompts ({args.long_min}-{args.long_max} in, {args.long_output} out) at {args.rate:g}/s from "
              f"t={args.delay:g} s; prefill budget {args.max_prefill_tokens} tokens a step\n")
        print("| setup | servers | decode ITL p50 / p99 ms, long prompts in flight | samples | ITL p50 / p99 ms, "
              "outside | output tok/s | long TTFT p50 / max ms | retractions | imports recomputed |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, r in results["setups"].items():
            print(f"| {name} | {', '.join(r['servers'])} | {r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} | "
                  f"{r['itl_samples']} | {r['itl_outside_p50_ms']:.2f} / {r['itl_outside_p99_ms']:.2f} | "
                  f"{r['output_tok_s']:,.0f} | {r['ttft_p50_ms']:,.0f} / {r['ttft_max_ms']:,.0f} | "
                  f"{r['num_retractions']} | {r['imports_recomputed']} |")
        for name in (n for n, r in results["setups"].items() if not r["decoding_at_every_arrival"]):
            print(f"\nwarning: in {name} a decoder finished before the last long prompt arrived (--decode-output)")
        print(f"\nKV moved from the prefill to the decode server in (b): {pd['kv_bytes_moved'] / 1e9:.3f} GB")
    t = pd["transfer"]
    if "kernel" in results:
        if "error" in results["kernel"]:
            print(f"\nthe kernel alone: failed ({results['kernel']['error']})")
        else:
            report_kernel(results["kernel"])
    report_transfer(t, bw, copy, pd["servers"])
    print("\n| target | wanted | measured | met |\n|---|---|---|---|")
    for row in results["targets"]:
        print(f"| {row['target']} | {row['wanted']} | {row['measured']} | {'yes' if row['met'] else 'no'} |")


if __name__ == "__main__":
    main()
