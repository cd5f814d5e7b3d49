"""The KV transfer part of `disaggregation.py` (its docstring says what each row measures): `kv_transfer` times
one prompt's KV between a prefill and a decode server that serve already, `report_transfer` prints its table."""

from __future__ import annotations

import json
import statistics
import time

import aiohttp
import torch

from tandem.server.disagg import HEADER


async def call(http: aiohttp.ClientSession, url: str, body: dict | None = None) -> bytes:
    """POST `body` (GET without one); the answer's bytes, RuntimeError unless 200."""
    async with http.request("GET" if body is None else "POST", url, json=body) as r:
        data = await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url} answered {r.status}: {data[:300].decode(errors='replace')}")
    return data


async def kv_transfer(http: aiohttp.ClientSession, prefill_url: str, decode_url: str, ids: list[int],
                      reps: int = 3) -> dict:
    """(i) export and (ii) end to end of `ids`'s KV, and (iii) the transfer's own times that the servers report
    (see the module docstring), median of `reps` each ((i), seconds each, of at most 3)."""
    info = json.loads(await call(http, f"{prefill_url}/pd/info"))
    offered = (info.get("transfer") or {}).get("kinds", ["bytes"])  # (what the decode server may choose from)
    itemsize = torch.empty(0, dtype=getattr(torch, info["kv_dtype"])).element_size()
    per_token = 2 * info["num_layers"] * info["num_kv_heads"] * info["head_dim"] * itemsize
    sampling = {"max_new_tokens": 2, "temperature": 0.0, "seed": 0, "ignore_eos": True}
    export, export_server, e2e = [], [], []
    for i in range(min(reps, 3) + 1):  # the first computes the prompt: not timed
        t0 = time.monotonic()
        async with http.post(f"{prefill_url}/pd/prefill", json={"rid": f"xfer{i}", "input_ids": ids,
                                                                "sampling_params": sampling, "kv_from": 0}) as r:
            body = await r.read()
            if r.status != 200:
                raise RuntimeError(f"/pd/prefill answered {r.status}: {body[:300].decode(errors='replace')}")
            export_server.append(json.loads(r.headers[HEADER])["export_s"])
        export.append(time.monotonic() - t0)
    for i in range(reps + 2):  # the first two warm the decode server's import (and compile its kernel): not timed
        await call(http, f"{decode_url}/flush_cache", {})  # so that it holds none of the prompt
        t0 = time.monotonic()
        out = json.loads(await call(http, f"{decode_url}/generate", {
            "rid": f"xfer-e2e{i}", "input_ids": ids, "sampling_params": sampling,
            "bootstrap": {"prefill_url": prefill_url}}))
        e2e.append(time.monotonic() - t0)
        assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
    records = json.loads(await call(http, f"{decode_url}/pd/transfers"))[-reps:]
    assert len(records) == reps and all(r["start"] == 0 and r["import_s"] is not None for r in records), records
    med = lambda key: statistics.median(r[key] for r in records)  # noqa: E731
    return {"tokens": len(ids), "offered": offered, "chosen": sorted({r["transfer"] for r in records}),
            "kv_bytes_per_token": per_token, "kv_bytes": len(ids) * per_token, "wire_bytes": len(body),
            "export_s": statistics.median(export[1:]), "export_bytes_server_s": statistics.median(export_server[1:]),
            "end_to_end_s": statistics.median(e2e[2:]), "prefill_export_s": med("export_s"),
            "decode_take_s": med("take_s"), "decode_copy_s": med("copy_s"), "decode_verify_s": med("verify_s"),
            "decode_write_s": med("write_s"), "decode_import_s": med("import_s"),
            **{f"decode_{key}": med(key) for key in ("queue_s", "check_s", "pass_s", "handoff_s", "path_s",
                                                      "launch_host_s", "pass_wait_s")
               if all(r.get(key) is not None for r in records)},
            **{f"path_{key}": statistics.median(r["path_parts"][key] for r in records)
               for key in ("pin_s", "to_server_s", "answer_s", "wire_s", "to_mail_s", "mail_s", "import_s")
               if all(key in (r.get("path_parts") or {}) for r in records)},
            "mailed": sum(bool(r.get("mailed")) for r in records), "armed": sum(bool(r.get("armed")) for r in records),
            "rung": sum(bool(r.get("rung")) for r in records),
            "launch_parts": _parts(records, "launch_parts"), "wait_parts": _parts(records, "wait_parts"),
            "landed": sum(bool(r.get("landed")) for r in records),
            "transfer_s": statistics.median(r["export_s"] + r["import_s"] for r in records), "records": records}


def _parts(records: list[dict], key: str) -> dict:
    """The median of each part of the records' `key` (a dict of seconds) that every record has."""
    parts = [r.get(key) or {} for r in records]
    return {name: statistics.median(p[name] for p in parts) for name in parts[0] if all(name in p for p in parts)}


def report_transfer(t: dict, bw: float, copy: str, servers: list[str]) -> None:
    """`kv_transfer`'s result `t` as a table, each row against the copy (`bw`: its bytes a second read + written;
    `copy`: what it is; `servers`: the two servers, named)."""
    copy_time = 2 * t["kv_bytes"] / bw
    print(f"\nShares: the {copy}'s time for the same bytes ({1e3 * copy_time:.3f} ms to read and write "
          f"{t['kv_bytes'] / 1e6:,.1f} MB) / the row's time: 100% = as fast as a plain copy. Old convention "
          "(KV bytes / time against the read + write bandwidth, up to 2026-12-02) = half of it.")
    print(f"\n| KV transfer of {t['tokens']} tokens ({t['kv_bytes'] / 1e6:,.1f} MB of KV, {t['wire_bytes'] / 1e6:,.1f} "
          f"MB as bytes), {', '.join(servers)} | ms | GB/s | copy time / time | old convention |\n"
          "|---|---|---|---|---|")
    chosen = f"{' / '.join(t['chosen'])}, of {' / '.join(t['offered'])} offered"
    for what, key in (("(i) export as bytes: /pd/prefill from the client, read out of the pool, checksummed, sent",
                       "export_s"),
                      ("(i') of which the prefill server's own: read, checksummed, serialised",
                       "export_bytes_server_s"),
                      (f"(ii) end to end: /generate through the decode server, one decode step ({chosen})",
                       "end_to_end_s"),
                      ("(iii) the transfer itself: (iv) + (v)", "transfer_s"),
                      ("(iv) prefill server: pages read out of its pool and checksummed, or pinned; shared",
                       "prefill_export_s"),
                      ("(v) decode server: from the answer to the pages written in its pool (synchronised)",
                       "decode_import_s"),
                      ("(v') of which: taken (mapped or received, copied, verified on its device)", "decode_take_s"),
                      ("(v'1) of (v'): mapped or received, and copied onto its device", "decode_copy_s"),
                      ("(v'2) of (v'): its page checksums computed and compared", "decode_verify_s"),
                      ("(v'') of which: the write into the pool (device time; by reference the fused pass)",
                       "decode_write_s"),
                      ("(v''a) of (v''): from the kernels' launch (device; before it the host readies their inputs; "
                       "by reference the prefill side's checksums from its records too)", "decode_pass_s"),
                      ("(v''') by reference, of (v): the answer to the pass starting (host; in the thread the answer "
                       "landed in where it was written so, else the engine's)", "decode_queue_s"),
                      ("(v'''') by reference, of (v): the pass queued to its checksums compared (host)",
                       "decode_check_s"),
                      ("(vi) by reference, after (v) where written as it landed: checked to the request queued in "
                       "the engine (host)", "decode_handoff_s"),
                      ("(vii) by reference, the whole way on one clock: the prefill engine having its KV ready (the "
                       "result of the step that computed it in hand) to the checksums compared (with the answer's "
                       "or the mail's way between the two, which (iii) leaves out)", "decode_path_s"),
                      ("(vii-0) before (vii), not of it: the prefill engine pinning the pages as it launched that "
                       "step (host)", "path_pin_s"),
                      ("(vii-2) of (vii): the KV ready to the prefill server's handler having the output (the engine "
                       "finishing the request, the hop between its threads)", "path_to_server_s"),
                      ("(vii-3) of (vii): the answer built", "path_answer_s"),
                      ("(vii-4) of (vii): the answer's way to the decode server's handler (HTTP)", "path_wire_s"),
                      ("(vii-2m) of (vii), by mail: the KV ready to its ready mail sent (the prefill engine's "
                       "thread; the pages were mailed as the step was launched)", "path_to_mail_s"),
                      ("(vii-4m) of (vii), by mail: the ready mail's way into the decode server's event loop",
                       "path_mail_s"),
                      ("(vii-5) of (vii): the decode server, the answer or ready mail in hand to the checksums "
                       "compared",
                       "path_import_s"),
                      ("(v''b) by reference, of (v): the pass's first mark to its kernels' launch (host)",
                       "decode_launch_host_s"),
                      ("(v''c) by reference, of (v): its kernels' launch to their sums on the host (host)",
                       "decode_pass_wait_s")):
        if key not in t or (key in ("decode_take_s", "decode_copy_s", "decode_verify_s") and "decode_queue_s" in t):
            continue  # (by reference nothing is taken before the engine's pass)
        seconds = max(t[key], 1e-9)
        print(f"| {what} | {1e3 * seconds:,.3f} | {t['kv_bytes'] / seconds / 1e9:,.2f} | "
              f"{copy_time / seconds:.1%} | {copy_time / seconds / 2:.1%} |")
    if "landed" in t:
        print(f"\nwritten as the answer landed (no turn of the engine's thread before the pass): {t['landed']} of "
              f"{len(t['records'])} timed transfers; of which came by mail (the prefill engine's side channel, "
              f"before the answer): {t.get('mailed', 0)}; of which were queued behind a doorbell the prefill "
              f"engine rang (engine.kv_doorbells): {t.get('armed', 0)}, of which it rang itself: {t.get('rung', 0)}")
    if t.get("launch_parts"):
        print("\nhost time of the decode's pass, first mark to launch (v''b), by part, ms: "
              + ", ".join(f"{name.removesuffix('_s')} {1e3 * s:.3f}" for name, s in t["launch_parts"].items()))
    if t.get("wait_parts"):
        print("\nhost time of the decode's pass, launch (armed: the ready mail in hand) to comparison (v''c and the "
              "check), by part, ms: "
              + ", ".join(f"{name.removesuffix('_s')} {1e3 * s:.3f}" for name, s in t["wait_parts"].items()))
    if "decode_write_s" in t and t.get("decode_import_s"):
        passes = t.get("decode_pass_s", t["decode_write_s"])
        print(f"\nhost-side overhead of (iii): (iii) minus the device pass (v''a, else v''): "
              f"{1e3 * (t['transfer_s'] - passes):.3f} ms")
