"""The host tier's copies alone, direct against staged: host time to issue one copy and device time for it to run,
between a device pool and pinned host pages of the model's KV layout. Needs CUDA.

    python benchmarks/page_move_bench.py [--model qwen3-0.6b] [--pages 1,4,16,64] [--out page_move.json]

A pool of `--pool-pages` device pages and `--host-pages` pinned host pages (bf16, pages of 16); each copy moves n
pages between scattered pool pages and scattered host pages (as most of the tier's copies: runs of one page). Per
n and direction, for (a) direct: one `move_pages` launch, its indices written into a pinned ring the kernel reads,
(b) staged_kernels: the staged halves as two launches (pool and staging, staging and host), on one stream here,
and (c) staged: the tier's halves (index upload, gather into staging, a `copy_` per run of host pages; for a load
the reverse and a scatter): host microseconds to issue one copy (mean of `reps` issued back to back, the stream
synchronised after) and device milliseconds for it (CUDA events, median), with the bus rate that gives. Then the
direct move's rate over the number of programs a launch runs (`page_move.PROGRAMS` is the default), and one
contiguous `copy_` of the same bytes each way (the copy engine's rate, the reference).
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch
from kv_copy_bench import _time  # (benchmarks/, beside this script)

from tandem.config import PRESETS
from tandem.kernels.page_move import PROGRAMS, IndexRing, move_pages, paged_store, pool_store


def device_ms(fn, reps: int) -> float:
    """Median device ms of `fn` (`kv_copy_bench._time`'s CUDA events)."""
    return 1e3 * _time(fn, reps)


def host_us(fn, reps: int) -> float:
    """Mean host time of one call, calls back to back (the device queue drained before and after)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-pages", type=int, default=2048)
    ap.add_argument("--host-pages", type=int, default=1024)
    ap.add_argument("--pages", default="1,4,16,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg, P = PRESETS[args.model], args.page_size
    L, K, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    dev, dtype = torch.device("cuda"), torch.bfloat16
    k = torch.randn((L, (args.pool_pages + 1) * P, K, D), device=dev, dtype=dtype)
    v = torch.randn_like(k)
    host = torch.zeros((args.host_pages, 2, L, P, K, D), dtype=dtype, pin_memory=True)
    pool, hstore = pool_store(k, v, None, P), paged_store(host)
    kp, vp = k.view(L, -1, P, K, D).transpose(0, 1), v.view(L, -1, P, K, D).transpose(0, 1)
    ring = IndexRing(1 << 16, pinned=True)
    page_bytes = 2 * L * P * K * D * dtype.itemsize
    gen = torch.Generator().manual_seed(0)
    print(f"# page moves, {torch.cuda.get_device_name()}, {args.model}: a page {page_bytes / 2**20:.2f} MiB "
          f"(L {L}, P {P}, K {K}, D {D}, bf16)\n")
    print("| pages | direction | direct: host us / device ms / GB/s | staged_kernels: the same | staged: the same |")
    print("|---|---|---|---|---|")
    rows = []

    def direct(out: bool, dpages: list[int], hpages: list[int]) -> None:
        src, dst = (pool, hstore) if out else (hstore, pool)
        at = ring.put(dpages + hpages if out else hpages + dpages)
        move_pages(src, dst, ring.buffer, len(dpages), at)
        ev = torch.cuda.Event()
        ev.record()
        ring.seal(ev)

    def kernels(out: bool, dpages: list[int], hpages: list[int]) -> None:
        """The staged halves as launches (`staged_kernels`): pool <-> staging, staging <-> host."""
        n = len(dpages)
        stage = paged_store(torch.empty((n, 2, L, P, K, D), dtype=dtype, device=dev))
        staged_rows = list(range(n))
        for src, dst, a, b in (((pool, stage, dpages, staged_rows), (stage, hstore, staged_rows, hpages)) if out
                               else ((hstore, stage, hpages, staged_rows), (stage, pool, staged_rows, dpages))):
            move_pages(src, dst, ring.buffer, n, ring.put(a + b))
        ev = torch.cuda.Event()
        ev.record()
        ring.seal(ev)

    def staged(out: bool, dpages: list[int], hpages: list[int]) -> None:
        idx = torch.tensor(dpages, dtype=torch.long, pin_memory=True).to(dev, non_blocking=True)
        stage = torch.empty((len(dpages), 2, L, P, K, D), dtype=dtype, device=dev)
        if out:
            torch.index_select(kp, 0, idx, out=stage[:, 0])
            torch.index_select(vp, 0, idx, out=stage[:, 1])
        for i, h in enumerate(hpages):  # (every run one page here)
            if out:
                host[h:h + 1].copy_(stage[i:i + 1], non_blocking=True)
            else:
                stage[i:i + 1].copy_(host[h:h + 1], non_blocking=True)
        if not out:
            kp[idx] = stage[:, 0]
            vp[idx] = stage[:, 1]

    for n in [int(x) for x in args.pages.split(",")]:
        dpages = torch.randperm(args.pool_pages, generator=gen)[:n].tolist()
        hpages = sorted(torch.randperm(args.host_pages // 2, generator=gen)[:n].mul(2).tolist())  # (runs of 1)
        for out in (True, False):
            got = {}
            for name, fn in (("staged", staged), ("staged_kernels", kernels), ("direct", direct)):  # (checked: last)
                call = functools.partial(fn, out, dpages, hpages)
                us, ms = host_us(call, args.reps), device_ms(call, args.reps)
                got[name] = (us, ms, n * page_bytes / ms / 1e6)
            want = torch.stack([kp[dpages], vp[dpages]], 1).cpu() if out else host[hpages]
            have = host[hpages] if out else torch.stack([kp[dpages], vp[dpages]], 1).cpu()
            assert torch.equal(want.view(torch.int16), have.view(torch.int16)), "the direct move's pages are wrong"
            direction = "backup (device -> host)" if out else "load (host -> device)"
            cells = ["{:.0f} / {:.3f} / {:.1f}".format(*got[name]) for name in ("direct", "staged_kernels", "staged")]
            print(f"| {n} | {direction} | {' | '.join(cells)} |")
            rows.append({"pages": n, "out": out, **{name: list(r) for name, r in got.items()}})
    n = max(int(x) for x in args.pages.split(","))
    dpages, hpages = list(range(n)), list(range(n))
    at = ring.put(dpages + hpages)
    sweep = {}
    for programs in (8, 16, 32, 64, 132, 264, 528):
        for out in (True, False):
            src, dst = (pool, hstore) if out else (hstore, pool)
            ms = device_ms(lambda src=src, dst=dst, p=programs: move_pages(src, dst, ring.buffer, n, at, programs=p),
                           args.reps)
            sweep[(programs, out)] = n * page_bytes / ms / 1e6
    print(f"\ndirect move of {n} pages, GB/s over programs a launch (default {PROGRAMS}), backup / load: " + ", ".join(
        f"{p} {sweep[(p, True)]:.1f} / {sweep[(p, False)]:.1f}" for p in (8, 16, 32, 64, 132, 264, 528)))
    flat = host[:n].view(-1)
    dflat = torch.empty(flat.numel(), dtype=dtype, device=dev)
    d2h = device_ms(lambda: flat.copy_(dflat, non_blocking=True), args.reps)
    h2d = device_ms(lambda: dflat.copy_(flat, non_blocking=True), args.reps)
    print(f"copy engine, one contiguous copy_ of {n} pages: device -> host {n * page_bytes / d2h / 1e6:.1f} GB/s, "
          f"host -> device {n * page_bytes / h2d / 1e6:.1f} GB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows,
                       "sweep": [[p, o, r] for (p, o), r in sweep.items()],
                       "copy_engine_gbs": [n * page_bytes / d2h / 1e6, n * page_bytes / h2d / 1e6]}, f, indent=1)


if __name__ == "__main__":
    main()
