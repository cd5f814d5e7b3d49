"""The one-pass KV transfer's kernel alone (`tandem.kernels.kv_copy` through `kv_index_sums.page_sums_by_index`),
device time, against a plain copy of the same bytes: what the KV transfer by reference costs on the device, so that
`disaggregation.py --transfer-only` can tell it from the host's part.

    python benchmarks/kv_copy_bench.py [--model qwen3-0.6b] [--tokens 8192] [--out kv_copy.json]
    python benchmarks/kv_copy_bench.py --sweep [--out kv_copy_sweep.json]

Two pools of the model's KV layout (bf16, pages of 16) holding `tokens` positions, the source's pages scattered;
timed with CUDA events, median of `reps` after a warm-up: (1) the fused pass (read the source pages, write the
destination pages, checksums of what it read; `page_sums_by_index` with a destination: both launches, keys and
values, and the sums over layers), (2) the checksum pass alone (a pass that only reads), (3)
`torch` copy of the same bytes, contiguous (the reference: `copy_time(B)`), (4) a torch gather by index of the same
pages (what the previous transfer did, three times); (5) a prefill server's forward recording the same positions'
checksum shares in every layer, (6) the export's checksums from those records, and (7) the fused pass with (6)
behind it (the decode server's import by reference); (8) that import's host time in this process alone, the call
to both sums on the host, and its parts (`host_times`: what the server adds shows beside it in
`disaggregation.py --transfer-only`). Each row: ms, and the copy's time over it (100% = as fast as the plain copy
of the same bytes).

`--sweep`: (1) and (2) again for each kernel tile of a grid (`kv_copy.Tile`: words a program holds at once, warps,
streaming loads and stores), each checked against the default tile's sums and written pages bit for bit, sorted
by time, the default and the best marked: `kv_copy.COPY_TILE` and `SUMS_TILE` are then set to the best.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch

from tandem.config import PRESETS


def _time(fn, reps: int) -> float:
    """Median device seconds of `fn` (CUDA events around each call, after two warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _pools(model: str, tokens: int, page_size: int, device: str) -> tuple[dict, list[int], list[int], int]:
    """Source and destination pools of `model`'s KV layout (bf16) with room for twice `tokens` positions, the
    source random, the pages of `tokens` positions scattered in each; and the KV bytes of `tokens` positions."""
    cfg = PRESETS[model]
    layers, heads, dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    pages = -(-tokens // page_size)
    shape = (layers, (2 * pages + 1) * page_size, heads, dim)
    t = {name: torch.randn(shape, device=device).to(torch.bfloat16) for name in ("src_k", "src_v")}
    t["dst_k"], t["dst_v"] = torch.zeros_like(t["src_k"]), torch.zeros_like(t["src_v"])
    gen = torch.Generator().manual_seed(0)
    src_pages = torch.randperm(2 * pages, generator=gen)[:pages].tolist()
    dst_pages = torch.randperm(2 * pages, generator=gen)[:pages].tolist()
    return t, src_pages, dst_pages, 2 * layers * tokens * heads * dim * 2


def kernel_times(model: str = "qwen3-0.6b", tokens: int = 8192, page_size: int = 16, reps: int = 20,
                 device: str = "cuda") -> dict:
    """The four device times above, in seconds, with the KV bytes moved; pools freed before it returns."""
    from tandem.engine.kv_index_sums import _kernel_ok, page_sums_by_index

    t, src_pages, dst_pages, kv_bytes = _pools(model, tokens, page_size, device)
    t["flat_src"] = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
    t["flat_dst"] = torch.empty_like(t["flat_src"])
    pos = torch.arange(tokens)
    slots = (torch.tensor(src_pages)[pos // page_size] * page_size + pos % page_size).to(device)
    out = {"model": model, "tokens": tokens, "kv_bytes": kv_bytes, "kernel": _kernel_ok(t["src_k"], t["dst_k"]),
           "fused_s": _time(lambda: page_sums_by_index(t["src_k"], t["src_v"], src_pages, 0, tokens, page_size,
                                                       t["dst_k"], t["dst_v"], dst_pages), reps),
           "sums_s": _time(lambda: page_sums_by_index(t["src_k"], t["src_v"], src_pages, 0, tokens, page_size),
                           reps),
           "copy_s": _time(lambda: t["flat_dst"].copy_(t["flat_src"]), reps),
           "gather_s": _time(lambda: (t["src_k"].index_select(1, slots), t["src_v"].index_select(1, slots)), reps)}
    t.clear()
    out |= record_times(model, tokens, page_size, reps, device)
    torch.cuda.empty_cache()
    return out


def record_times(model: str, tokens: int, page_size: int, reps: int, device: str) -> dict:
    """A prefill server's checksum records (`KVPool(slot_sums=True)`): the device time its forward spends recording
    `tokens` positions in every layer (`records_s`: one launch, as the forward makes it), its export's sums from
    them (`page_sums_s`: what replaces the checksum pass), and the decode's fused pass with them behind it
    (`fused_records_s`, into a second pool: `page_sums_by_index(records=...)`), and its host time (`host_times`)."""
    from tandem.engine.kv_index_sums import host_sums, page_sums_by_index, record_sums_by_index
    from tandem.engine.kv_pool import KVPool

    cfg = PRESETS[model]
    pages = -(-tokens // page_size)
    pool = KVPool(cfg, 2 * pages, page_size, torch.bfloat16, device, slot_sums=True)
    for cache in (pool.k_cache, pool.v_cache):
        cache.copy_(torch.randn(cache.shape, device=device))
    table = torch.randperm(2 * pages, generator=torch.Generator().manual_seed(1))[:pages].tolist()
    slots = pool.slots(table, 0, tokens)

    dst = torch.zeros_like(pool.k_cache), torch.zeros_like(pool.v_cache)
    return {"records_s": _time(lambda: pool.record_sums(slots), reps),
            "page_sums_s": _time(lambda: record_sums_by_index(pool.sums, table, 0, tokens, page_size), reps),
            "fused_records_s": _time(lambda: page_sums_by_index(pool.k_cache, pool.v_cache, table, 0, tokens,
                                                                page_size, *dst, table, records=pool.sums), reps),
            **host_times(lambda clock: host_sums(page_sums_by_index(
                pool.k_cache, pool.v_cache, np.asarray(table, dtype="<i4"), 0, tokens, page_size, *dst, table,
                clock, records=pool.sums), clock), device, reps)}


def host_times(pass_, device: str, reps: int) -> dict:
    """The decode's pass as a decode server runs it (`pass_(clock)`: the fused pass with the records' sums behind
    it, then the host's wait for both), in this process alone, timed on the host by its `TransferClock`: the
    median of `reps` after a warm-up, of the whole call (`pass_host_s`) and of each part from one mark to the next
    (`pass_host_parts`: the index staged, the first launch, the kernels queued, the wait returned, the sums read).
    What a server's `/pd/transfers` shows beyond these is the server's own."""
    from tandem.engine.kv_transfer import TransferClock

    names, wholes, parts = ("call", "staged", "launch", "launched", "synced", "read"), [], []
    for i in range(reps + 2):
        clock = TransferClock(device)
        clock.mark("call", device=False)
        pass_(clock)
        clock.mark("read", device=False)
        if i >= 2:
            wholes.append(clock.host["read"] - clock.host["call"])
            parts.append(clock.parts(names))  # (off a GPU: fewer marks)
    return {"pass_host_s": statistics.median(wholes),
            "pass_host_parts": {name: statistics.median(p[name] for p in parts) for name in parts[0]}}


SWEEP_WORDS = (1024, 2048, 4096, 8192, 16384)
SWEEP_WARPS = (2, 4, 8, 16)


def sweep(model: str = "qwen3-0.6b", tokens: int = 8192, page_size: int = 16, reps: int = 20,
          device: str = "cuda") -> dict:
    """Device times of the fused pass and the checksum pass for each tile of the grid (`SWEEP_WORDS` x
    `SWEEP_WARPS`, plain; and at 2,048-8,192 words and 4 or 8 warps, streaming, deferred, and both), each checked
    against the default tile's output bit for bit (a tile that differs or fails is reported, never chosen), with
    the plain copy's time of the same bytes."""
    from tandem.engine.kv_index_sums import _kernel_ok, canonical, page_sums_by_index
    from tandem.kernels.kv_copy import COPY_TILE, SUMS_TILE, Tile

    t, src_pages, dst_pages, kv_bytes = _pools(model, tokens, page_size, device)
    if not _kernel_ok(t["src_k"], t["dst_k"]):
        raise ValueError(f"--sweep: the kernel does not take {model}'s pools on {device}")
    flat = {"src": torch.empty(kv_bytes, dtype=torch.uint8, device=device)}
    flat["dst"] = torch.empty_like(flat["src"])
    copy_s = _time(lambda: flat["dst"].copy_(flat["src"]), reps)
    flat.clear()

    def run(tile, write: bool) -> torch.Tensor:  # (the sums as compared: their column parts' low 32 bits)
        if write:
            t["dst_k"].zero_(), t["dst_v"].zero_()
            sums = page_sums_by_index(t["src_k"], t["src_v"], src_pages, 0, tokens, page_size, t["dst_k"],
                                      t["dst_v"], dst_pages, tile=tile)
        else:
            sums = page_sums_by_index(t["src_k"], t["src_v"], src_pages, 0, tokens, page_size, tile=tile)
        return canonical(sums.cpu())

    expect = {write: run(COPY_TILE if write else SUMS_TILE, write) for write in (True, False)}
    written = t["dst_k"].clone(), t["dst_v"].clone()  # (the default's pages)
    tiles = [Tile(w, n) for w in SWEEP_WORDS for n in SWEEP_WARPS] + \
            [Tile(w, n, stream, defer) for stream, defer in ((True, False), (False, True), (True, True))
             for w in (2048, 4096, 8192) for n in (4, 8)]
    rows = []
    for write in (True, False):
        for tile in tiles:
            row = {"pass": "fused" if write else "sums", "words": tile.words, "num_warps": tile.num_warps,
                   "stream": tile.stream, "defer": tile.defer, "default": tile == (COPY_TILE if write else SUMS_TILE)}
            try:
                same = torch.equal(run(tile, write), expect[write])
                if write:
                    same &= torch.equal(t["dst_k"], written[0]) and torch.equal(t["dst_v"], written[1])
                if not same:
                    raise ValueError("its output differs from the default tile's")
                row["s"] = _time(lambda tile=tile, write=write: page_sums_by_index(
                    t["src_k"], t["src_v"], src_pages, 0, tokens, page_size, *((t["dst_k"], t["dst_v"], dst_pages)
                                                                               if write else ()), tile=tile), reps)
            except Exception as e:  # (one tile that cannot compile or run must not end the sweep)
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
    t.clear()
    del written
    torch.cuda.empty_cache()
    best = {p: min((r for r in rows if r["pass"] == p and "s" in r), key=lambda r: r["s"], default=None)
            for p in ("fused", "sums")}
    return {"model": model, "tokens": tokens, "kv_bytes": kv_bytes, "copy_s": copy_s, "rows": rows, "best": best}


def report_sweep(result: dict) -> None:
    copy = result["copy_s"]
    print(f"\n| tile sweep ({result['tokens']} tokens, {result['kv_bytes'] / 1e6:,.1f} MB; plain copy "
          f"{1e3 * copy:.3f} ms) | words | warps | stream | defer | ms | copy time / time |\n"
          "|---|---|---|---|---|---|---|")
    for p in ("fused", "sums"):
        rows = sorted((r for r in result["rows"] if r["pass"] == p), key=lambda r: r.get("s", float("inf")))
        for r in rows:
            mark = (" (best)" if r is result["best"][p] else "") + (" (default)" if r["default"] else "")
            ms = f"{1e3 * r['s']:.3f} | {copy / r['s']:.0%}" if "s" in r else f"failed: {r['error']} | -"
            print(f"| {p}{mark} | {r['words']} | {r['num_warps']} | {r['stream']} | {r['defer']} | {ms} |")
    for p, name in (("fused", "COPY_TILE"), ("sums", "SUMS_TILE")):
        if (b := result["best"][p]) is not None:
            print(f"best {p}: kv_copy.{name} = Tile({b['words']}, {b['num_warps']}, stream={b['stream']}, "
                  f"defer={b['defer']}) "
                  f"({1e3 * b['s']:.3f} ms, {copy / b['s']:.0%} of the copy)")


def report(times: dict) -> None:
    copy = times["copy_s"]
    print(f"\n| the transfer's kernel alone ({times['tokens']} tokens, {times['kv_bytes'] / 1e6:,.1f} MB of KV, "
          f"device time; Triton: {'yes' if times['kernel'] else 'NO (torch path)'}) | ms | copy time / time |")
    print("|---|---|---|")
    for what, key in (("fused: read the pages, write them, checksums (decode server's write)", "fused_s"),
                      ("checksums alone (a pass that only reads)", "sums_s"),
                      ("torch copy of the same bytes, contiguous (the reference)", "copy_s"),
                      ("torch gather by index of the same pages (keys and values)", "gather_s")):
        print(f"| {what} | {1e3 * times[key]:.3f} | {copy / times[key]:.0%} |")
    for what, key in (("a prefill's forward recording every layer's checksum shares (`KVPool.record_sums`)",
                       "records_s"),
                      ("the export's checksums from the records (`record_sums_by_index`: replaces the pass)",
                       "page_sums_s"),
                      ("the fused pass, then the checksums from the records (the decode server's import)",
                       "fused_records_s")):
        if key in times:
            print(f"| {what} | {1e3 * times[key]:.3f} | {copy / times[key]:.0%} |")
    if "pass_host_s" in times:
        print(f"| the decode's pass in this process alone, host: the call to both sums in hand | "
              f"{1e3 * times['pass_host_s']:.3f} | {copy / times['pass_host_s']:.0%} |")
        print("\nits host time by part (each from the mark before), ms: " + ", ".join(
            f"{name.removesuffix('_s')} {1e3 * s:.3f}" for name, s in times["pass_host_parts"].items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out")
    p.add_argument("--sweep", action="store_true", help="time the kernel's tiles (kv_copy.Tile) instead")
    args = p.parse_args()
    if args.sweep:
        times = sweep(args.model, args.tokens)
        report_sweep(times)
    else:
        times = kernel_times(args.model, args.tokens)
        report(times)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(times, f, indent=1)


if __name__ == "__main__":
    main()
