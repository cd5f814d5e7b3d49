"""Soak: the random agent under scheduled faults, resumed after every kill as an operator would, then checked.

    python benchmarks/soak.py [--minutes 30] [--fault-every 20] [--kill-every 300] [--out runs/soak]
                              [--json FILE] [--set section.key=value ...]

    start `tandem run` (CPU, tiny model, placement=separate, checkpoint_every=1): a leg; find its engine (the
    trainer's child process whose listening port answers /engine_stats)
    until the time is up:
        every fault_every s, the next of: client disconnects (generates dropped mid-way), hostile requests (bad
        sampling params and token ids, malformed JSON, oversized bodies), pauses in every mode; all from outside,
        at the engine the run uses, while it generates
        every kill_every s, once the leg trained a step, the next of: SIGKILL the engine (the run must fail naming it)
        and SIGKILL the trainer (its engine must go with it); then a new leg with resume=true
        a leg that exits or stalls (no step for stall_s) unasked is an unplanned failure; it is resumed too
        sample the RSS of the trainer's and the engine's processes
    once the last leg trained a step: freeze the trainer (SIGSTOP), let the engine drain, read its page pools,
    flush its cache and read them again; then SIGCONT and SIGTERM (the run saves its checkpoint)
    check metrics.jsonl and checkpoint.pt: no group trained twice, no policy token trained more than
    rollout.max_staleness versions after it was sampled, every admitted group trained, dropped, buffered or listed
    for re-running

Prints a markdown table and writes the whole report as JSON (`--json`, default OUT/soak.json). Everything runs on
the CPU; the engine's faults hit its HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from outside import alive, engine_stats, find_engine, hostile_requests, request, rss_mb, wait_gone

ROOT = Path(__file__).resolve().parents[1]
PAUSE_MODES = ("abort", "retract", "in_place")
DISCONNECTS = 4  # generates opened and dropped per disconnect fault
EXIT_TIMEOUT_S = 180.0  # for a run to fail after its engine is killed (a weight sync waits up to 120 s)
DRAIN_TIMEOUT_S = 120.0
PROBE_HOLD = 1  # pages a 1-token request's pending backup holds, on the device and on the host
BASELINE = "end, after one more 1-token generate and a flush"
WARM_S = 60.0  # RSS growth is measured from this long after a process starts


# ---- the soak ---------------------------------------------------------------------------------------------------
@dataclass
class Leg:
    """One `tandem run` process, from its start to its exit."""

    process: subprocess.Popen
    log: Path
    base_step: int  # the last recorded step when it started
    engine: tuple[int, int] | None = None  # (pid, port), once found
    progressed: bool = False  # trained a step of its own


@dataclass
class Soak:
    args: argparse.Namespace
    out: Path
    t0: float = field(default_factory=time.monotonic)
    legs: list[Leg] = field(default_factory=list)
    unplanned: list[dict] = field(default_factory=list)
    faults: Counter = field(default_factory=Counter)
    kill_exit_s: list[float] = field(default_factory=list)  # from an engine kill to the run's exit
    disconnects_aborted: list[int] = field(default_factory=list)
    rss: dict = field(default_factory=dict)  # (role, pid) -> [(t, MB)]
    pools: dict = field(default_factory=dict)  # label -> engine stats
    step: int = 0  # the last recorded step
    progress_at: float = 0.0  # when it changed (or the leg started)

    @property
    def leg(self) -> Leg:
        return self.legs[-1]

    @property
    def now(self) -> float:
        return time.monotonic() - self.t0

    def fail(self, what: str, detail: str = "") -> None:
        self.unplanned.append({"t_s": round(self.now, 1), "what": what, "detail": detail[-2000:]})
        print(f"[{self.now:7.1f}s] UNPLANNED: {what} {detail[-300:]}", flush=True)

    def note(self, text: str) -> None:
        print(f"[{self.now:7.1f}s] {text}", flush=True)

    # ---- legs
    def start_leg(self) -> None:
        resume = (self.out / "checkpoint.pt").is_file()
        log = self.out / "legs" / f"leg{len(self.legs):03d}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "tandem.cli", "run", "placement=separate", "checkpoint_every=1",
               "steps=1000000", "engine.host_cache=write_through", f"out_dir={self.out}",
               f"resume={str(resume).lower()}", *self.args.set]
        with open(log, "w") as f:
            process = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self.legs.append(Leg(process, log, self.last_step()))
        self.progress_at, self.step = time.monotonic(), self.last_step()
        self.note(f"leg {len(self.legs) - 1}: pid {process.pid}, resume={resume}, from step {self.step}")

    def end_leg(self, grace_s: float = 30.0) -> None:
        """Stop the leg (SIGTERM, then SIGKILL) and any engine of it still running."""
        process = self.leg.process
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.terminate()
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.leg.engine and not wait_gone(self.leg.engine[0], grace_s):
            self.fail("engine outlived its run", f"pid {self.leg.engine[0]}")
            os.kill(self.leg.engine[0], signal.SIGKILL)

    def restart(self) -> None:
        self.end_leg()
        self.start_leg()

    def log_text(self) -> str:
        return self.leg.log.read_text(errors="replace")

    def last_step(self) -> int:
        try:
            with open(self.out / "metrics.jsonl", "rb") as f:
                f.seek(max(f.seek(0, 2) - 65536, 0))
                lines = f.read().splitlines()
        except FileNotFoundError:
            return 0
        for line in reversed(lines):
            try:
                return json.loads(line)["step"]
            except (ValueError, KeyError):
                continue  # a line being written
        return 0

    def watch(self) -> None:
        """Notice exits, stalls, progress and the leg's engine; sample RSS."""
        leg = self.leg
        if (code := leg.process.poll()) is not None:
            self.fail(f"run exited with code {code}", self.log_text())
            return self.restart()
        if (step := self.last_step()) != self.step:
            self.step, self.progress_at = step, time.monotonic()
            leg.progressed |= step > leg.base_step
        if time.monotonic() - self.progress_at > self.args.stall_s:
            self.fail(f"no step for {self.args.stall_s:g} s", self.log_text())
            return self.restart()
        if leg.engine is None and (found := find_engine(leg.process.pid)):
            leg.engine = found
            self.pools.setdefault("start (first engine, when found)", engine_stats(found[1]))
            self.note(f"engine pid {found[0]} on port {found[1]}")
        for role, pid in (("trainer", leg.process.pid), ("engine", leg.engine and leg.engine[0])):
            if pid and (mb := rss_mb(pid)) is not None:
                self.rss.setdefault((role, pid), []).append((round(self.now, 1), round(mb, 1)))

    # ---- kills
    def kill_engine(self) -> None:
        pid = self.leg.engine[0]
        os.kill(pid, signal.SIGKILL)
        t = time.monotonic()
        try:
            code = self.leg.process.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return self.fail(f"run still running {EXIT_TIMEOUT_S:g} s after its engine was killed", self.log_text())
        self.kill_exit_s.append(time.monotonic() - t)
        if code == 0 or f"pid {pid}" not in self.log_text():
            self.fail(f"run's exit (code {code}) does not name its killed engine", self.log_text())

    def kill_trainer(self) -> None:
        self.leg.process.kill()
        self.leg.process.wait()
        if not wait_gone(self.leg.engine[0], 30):
            self.fail("engine outlived its killed trainer by 30 s", f"pid {self.leg.engine[0]}")

    # ---- faults from outside, at the engine the run uses; each returns what went wrong
    def disconnects(self, port: int) -> list[str]:
        before = engine_stats(port)["num_aborted"]  # (TypeError if the engine is gone)
        body = json.dumps({"input_ids": [random.randrange(2, 500) for _ in range(32)],
                           "sampling_params": {"max_new_tokens": 1024, "ignore_eos": True}}).encode()
        head = (f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(DISCONNECTS)]
        for s in socks:
            s.sendall(head + body)
        time.sleep(1.0)  # generating by now
        for s in socks:
            s.close()
        deadline = time.monotonic() + 15
        while (aborted := engine_stats(port)["num_aborted"] - before) < DISCONNECTS:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        self.disconnects_aborted.append(aborted)
        return [] if aborted >= DISCONNECTS else [f"{aborted} of {DISCONNECTS} dropped generates aborted in 15 s"]

    def hostile(self, port: int) -> list[str]:
        wrong = []
        for method, path, body in hostile_requests():
            status, data = request(port, method, path, body)
            self.faults["hostile requests"] += 1
            if not 400 <= status < 500:
                shown = body if isinstance(body, dict) else repr(body)[:80] if isinstance(body, bytes) else "chunked"
                wrong.append(f"{method} {path} {shown}: {status} {data[:200]!r}")
        status, data = request(port, "POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": {
            "max_new_tokens": 4, "ignore_eos": True}})  # (the tiny model may sample its EOS: 4 tokens all the same)
        if status != 200 or len(json.loads(data).get("output_ids", [])) != 4:
            wrong.append(f"an innocent generate after them: {status} {data[:200]!r}")
        return wrong

    def pauses(self, port: int) -> list[str]:
        wrong = []
        for mode in PAUSE_MODES:
            replies = [request(port, "POST", "/pause_generation", {"mode": mode})]
            time.sleep(self.args.pause_s)
            replies.append(request(port, "POST", "/continue_generation", {}))
            self.faults[f"pauses ({mode})"] += 1
            wrong += [f"{mode}: {status} {data[:200]!r}" for status, data in replies if status != 200]
        return wrong

    def external_fault(self, kind: str) -> None:
        pid, port = self.leg.engine
        self.faults[kind] += 1
        self.note(f"fault: {kind}")
        try:
            wrong = getattr(self, kind)(port)
        except (OSError, TypeError) as e:  # refused, or no stats: the engine is gone (or broken)
            wrong = [repr(e)]
        if wrong and alive(pid):  # (an engine that died meanwhile is the leg's story, told by watch)
            self.fail(f"{kind}: the engine answered wrongly", "; ".join(wrong))

    # ---- the whole soak
    def run(self) -> dict:
        self.start_leg()
        external = itertools.cycle(["pauses", "disconnects", "hostile"])
        kills = itertools.cycle(["engine", "trainer"])
        next_fault, next_kill, deadline = self.args.fault_every, self.args.kill_every, self.args.minutes * 60
        num_kills = 0
        try:
            while self.now < deadline or num_kills < self.args.min_kills:
                self.watch()
                engine_up = self.leg.engine is not None and self.leg.process.poll() is None
                if engine_up and self.leg.progressed and self.now >= next_kill:
                    kind = next(kills)
                    self.faults[f"{kind} killed (SIGKILL)"] += 1
                    self.note(f"fault: SIGKILL the {kind}")
                    getattr(self, f"kill_{kind}")()
                    self.restart()
                    num_kills += 1
                    next_kill = self.now + self.args.kill_every
                elif engine_up and self.now >= next_fault:
                    self.external_fault(next(external))
                    next_fault = self.now + self.args.fault_every
                time.sleep(0.5)
            self.finish()
        finally:
            self.end_leg()
        return self.report()

    def finish(self) -> None:
        """Freeze the trainer, let the engine drain, read its pools before and after a flush; then SIGTERM."""
        while not self.leg.progressed or self.leg.process.poll() is not None:  # (then its engine is found)
            self.watch()
            time.sleep(0.5)
        pid, port = self.leg.engine
        self.leg.process.send_signal(signal.SIGSTOP)
        deadline, idle_since = time.monotonic() + DRAIN_TIMEOUT_S, None
        while stats := engine_stats(port):  # drained: nothing runs for a second (requests the frozen trainer had
            now = time.monotonic()           # sent may still sit in the socket's buffer when the first read says 0)
            busy = stats["num_running"] + stats["num_queued"] > 0
            idle_since = None if busy else idle_since or now
            if idle_since is not None and now - idle_since >= 1.0:
                break
            if now > deadline:
                self.fail(f"the engine did not drain in {DRAIN_TIMEOUT_S:g} s", json.dumps(stats))
                break
            time.sleep(0.25)
        self.pools["end, drained (cache kept)"] = stats
        self.flush_and_read(port, "end, cache flushed")
        # the copies a write-through tier issued in the last step hold their pages until a step reaps them: one
        # more request's step does, leaving its own backup (PROBE_HOLD pages) pending instead
        request(port, "POST", "/generate", {"input_ids": [7], "sampling_params": {"max_new_tokens": 1}})
        self.flush_and_read(port, BASELINE)
        self.leg.process.send_signal(signal.SIGCONT)
        self.leg.process.terminate()
        if (code := self.leg.process.wait(60)) != 128 + signal.SIGTERM:
            self.fail(f"SIGTERM at the end: exit code {code}, expected 143", self.log_text())
        if not wait_gone(pid, 30):
            self.fail("engine outlived its run's SIGTERM", f"pid {pid}")

    def flush_and_read(self, port: int, label: str) -> None:
        status, data = request(port, "POST", "/flush_cache", {})
        if status != 200:
            self.fail(f"flush_cache ({label})", f"{status} {data[:300]!r}")
        self.pools[label] = engine_stats(port)

    def report(self) -> dict:
        import torch  # (only here: the soak itself stays light)

        records = [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines() if line]
        config = json.loads((self.out / "config.json").read_text())
        bound = config["rollout"]["max_staleness"]
        state = torch.load(self.out / "checkpoint.pt", weights_only=True)
        manager = state["manager"]
        trained = Counter(i for r in records for i in r["group_ids"])
        dropped_ids = set(manager["dropped_indices"])
        held = {int(i) for i in manager["buffer"]} | set(manager["rerun"])
        steps = [r["step"] for r in records]
        pools = self.pools
        end = pools.get(BASELINE) or {}
        return {
            "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "command": " ".join(["python", "benchmarks/soak.py", *sys.argv[1:]]), "wall_s": round(self.now, 1),
            "legs": len(self.legs), "steps": len(records), "trainer_version": state["trainer"]["version"],
            "steps_once_each": steps == list(range(1, len(steps) + 1)),
            "groups_admitted": manager["next_index"], "groups_trained": len(trained),
            "groups_dropped": dict(manager["dropped"]), "groups_buffered_or_rerun": len(held),
            "groups_unaccounted": len(set(range(manager["next_index"])) - set(trained) - dropped_ids - held),
            "groups_trained_and_dropped": len(set(trained) & dropped_ids),
            "duplicates": sum(n - 1 for n in trained.values()),
            "max_staleness": bound, "staleness_max_seen": max((r["staleness_max"] for r in records), default=0),
            "staleness_violation_tokens": sum(sum(r["staleness_tokens"][bound + 1:]) for r in records),
            "staleness_violation_steps": sum(r["staleness_max"] > bound for r in records),
            "faults": dict(self.faults), "engine_kill_to_exit_s": [round(s, 1) for s in self.kill_exit_s],
            "disconnects_aborted": self.disconnects_aborted,
            "unplanned": self.unplanned,
            "mtbf_unplanned_s": round(self.now / len(self.unplanned), 1) if self.unplanned else None,
            "pools": pools,
            "pools_back_to_baseline": bool(end) and end["pages_total"] - end["pages_free"] <= PROBE_HOLD
                                      and end["host_pages_total"] - end["host_pages_free"] <= PROBE_HOLD,
            "rss": rss_summary(self.rss),
        }


def rss_summary(samples: dict) -> dict:
    """Per role: the peak RSS, and the growth of its longest-lived process from WARM_S after its start."""
    out = {}
    for role in ("trainer", "engine"):
        series = [s for (r, _), s in samples.items() if r == role and len(s) > 1]
        if not series:
            continue
        longest = max(series, key=lambda s: s[-1][0] - s[0][0])
        warm = next((p for p in longest if p[0] >= longest[0][0] + WARM_S), longest[0])
        minutes = (longest[-1][0] - warm[0]) / 60 if warm is not longest[0] else 0  # too short-lived to tell
        out[role] = {"processes": len(series), "peak_mb": max(mb for s in series for _, mb in s),
                     "longest_life_s": round(longest[-1][0] - longest[0][0]), "warm_mb": warm[1],
                     "end_mb": longest[-1][1],
                     "growth_mb_per_min": round((longest[-1][1] - warm[1]) / minutes, 2) if minutes > 0 else None,
                     # the longest-lived one's RSS at each whole minute of its life: a plateau, or steady growth
                     "longest_by_minute_mb": [next(mb for t, mb in longest if t >= longest[0][0] + 60 * m)
                                              for m in range(int((longest[-1][0] - longest[0][0]) // 60) + 1)],
                     "each_process_peak_mb": [max(mb for _, mb in s) for s in series]}
    return out


def print_table(r: dict) -> None:
    pools = r["pools"]
    rows = [
        ("wall / legs (restarts + 1) / steps", f"{r['wall_s'] / 60:.1f} min / {r['legs']} / {r['steps']}", ""),
        ("groups admitted / trained / buffered or to re-run", f"{r['groups_admitted']} / {r['groups_trained']} / "
         f"{r['groups_buffered_or_rerun']}", ""),
        ("groups dropped, by reason", json.dumps(r["groups_dropped"]) if r["groups_dropped"] else "0", "0"),
        ("groups unaccounted / trained and dropped", f"{r['groups_unaccounted']} / {r['groups_trained_and_dropped']}",
         "0 / 0"),
        ("groups trained twice (duplicates)", str(r["duplicates"]), "0"),
        ("each step recorded once", str(r["steps_once_each"]), "True"),
        (f"staleness violations (> {r['max_staleness']}): tokens / steps; max seen",
         f"{r['staleness_violation_tokens']} / {r['staleness_violation_steps']}; {r['staleness_max_seen']:.0f}",
         "0 / 0"),
        ("faults injected", ", ".join(f"{k} {v}" for k, v in r["faults"].items()), ""),
        ("engine kill -> run exit, s", ", ".join(map(str, r["engine_kill_to_exit_s"])) or "-", ""),
        ("dropped generates aborted, per fault", ", ".join(map(str, r["disconnects_aborted"])) or "-",
         str(DISCONNECTS)),
        ("unplanned failures / MTBF", f"{len(r['unplanned'])} / "
         + (f"{r['mtbf_unplanned_s'] / 60:.1f} min" if r["unplanned"] else f"none in {r['wall_s'] / 60:.1f} min"),
         "0"),
    ]
    for label, s in pools.items():
        if s:
            rows.append((f"KV pages free / cached / total; host free / total: {label}",
                         f"{s['pages_free']} / {s['pages_cached']} / {s['pages_total']}; {s['host_pages_free']} / "
                         f"{s['host_pages_total']} (running {s['num_running']})", ""))
    rows.append((f"pools back to baseline after drain + flush (but {PROBE_HOLD} page of the last backup)",
                 str(r["pools_back_to_baseline"]), "True"))
    for role, m in r["rss"].items():
        rows.append((f"RSS {role}: peak; longest-lived ({m['longest_life_s']} s of {m['processes']} processes)",
                     f"{m['peak_mb']:.0f} MB; {m['warm_mb']:.0f} -> {m['end_mb']:.0f} MB "
                     f"({m['growth_mb_per_min']} MB/min after {WARM_S:g} s)", ""))
    print(f"\n`{r['command']}` ({r['date']}, {r['machine']})\n")
    print("| measure | value | target |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for u in r["unplanned"]:
        print(f"- unplanned at {u['t_s']} s: {u['what']}: {u['detail'][-300:]!r}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--fault-every", type=float, default=20.0, help="seconds between the outside faults")
    p.add_argument("--kill-every", type=float, default=300.0, help="seconds between kills (engine, trainer, ...)")
    p.add_argument("--min-kills", type=int, default=0, help="go on past --minutes until this many kills are done")
    p.add_argument("--stall-s", type=float, default=240.0, help="a leg without a step this long has stalled")
    p.add_argument("--pause-s", type=float, default=1.0, help="how long each outside pause holds")
    p.add_argument("--out", default="runs/soak", help="the run's out_dir (emptied first)")
    p.add_argument("--json", help="where to write the report (default: OUT/soak.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", nargs="*", default=[], help="more section.key=value overrides of the run")
    args = p.parse_args(argv)
    random.seed(args.seed)
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    report = Soak(args, out).run()
    Path(args.json or out / "soak.json").write_text(json.dumps(report, indent=1, default=str))
    print_table(report)
    return report


if __name__ == "__main__":
    main()
