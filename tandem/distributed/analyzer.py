"""Analyzer: reads every rank's flight recorder journal and dumps in a directory and says, first, why the ranks stopped.

`analyze(dump_dir)` returns a `Verdict`; `main(argv)` (`tandem analyze DUMP_DIR [--boot ID]`) prints its text: the
verdict on the first line, then the evidence; `export_torch` rewrites the records for PyTorch's own `fr_trace`.
Per rank it reads the newest boot (or `--boot`), merging the journal (both rotation files) with the dumps: the
journal survives a killed process, a dump carries the state providers.

The verdict, in order of precedence:
1. mismatch: at the same sequence number of one process group, ranks issued different ops, shapes or dtypes.
   The culprits are the ranks outside the majority; with a tie (two ranks) rank 0, the leader whose tokens the
   others follow, is the reference.
2. missing: ranks wait in a collective that other members never issued. When ranks wait in different
   collectives (a rank that skipped one waits in the next, so each side misses the other's), the collective with
   the most waiting ranks is the verdict, ties going to the one that the lowest rank waits in.
3. stuck: every member issued the collective, yet some never saw it complete (transport stall, a peer dead inside).
4. stopped: nothing waits on anyone; where each rank stopped. 5. no_data: no recorder files.
"""

from __future__ import annotations

import argparse
import ast
import json
import pickle
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from tandem.distributed.flight_recorder import DUMP, JOURNAL, TORCH_FR_VERSION, sanitize_id

NAME_RE = re.compile(rf"^({JOURNAL}|{DUMP})\.([A-Za-z0-9_-]+)\.rank(\d+)(?:\.(\d+))?\.(jsonl|json)(\.1)?$")
_DONE_STATES = ("completed", "failed")


@dataclass
class RankRecords:
    rank: int
    boot_id: str
    time_boot_ns: int = 0
    entries: dict[int, dict] = field(default_factory=dict)  # record_id -> entry
    groups: dict[str, dict] = field(default_factory=dict)  # process group name -> {"name", "desc", "ranks"}
    dumps: list[dict] = field(default_factory=list)  # reason, time_dump_ns, state, stacks_file (entries dropped)
    files: list[str] = field(default_factory=list)

    def last(self, kind: str) -> dict | None:
        found = [e for e in self.entries.values() if e.get("kind", "collective") == kind]
        return max(found, key=lambda e: e["record_id"], default=None)

    @property
    def latest_ns(self) -> int:
        times = [d.get("time_dump_ns") or 0 for d in self.dumps]
        for e in self.entries.values():
            times += [e.get("time_created_ns") or 0, e.get("time_discovered_completed_ns") or 0]
        return max(times, default=0)


@dataclass
class Verdict:
    kind: str  # mismatch | missing | stuck | stopped | no_data
    headline: str
    culprits: tuple[int, ...] = ()
    pg: str | None = None  # the process group's description, else its name
    seq: int | None = None  # collective_seq_id
    op: str | None = None  # profiling_name, e.g. "gloo:all_reduce"
    waiting: tuple[int, ...] = ()
    evidence: list[str] = field(default_factory=list)
    ranks: dict[int, RankRecords] = field(default_factory=dict, repr=False)

    def text(self) -> str:
        return "\n".join([f"VERDICT: {self.headline}", "", "EVIDENCE:", *(f"  {line}" for line in self.evidence)])


def _read_json_lines(path: Path):
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:  # the line a killed process was writing
            continue


def _enter_boot(records: RankRecords, time_boot_ns: int) -> bool:
    """Only the newest boot counts when a boot id was reused by mistake; False for records of an older boot."""
    if time_boot_ns < records.time_boot_ns:
        return False
    if time_boot_ns > records.time_boot_ns:
        records.entries.clear()
        records.dumps.clear()
        records.time_boot_ns = time_boot_ns
    return True


def _load_file(records: RankRecords, path: Path, is_journal: bool) -> None:
    records.files.append(path.name)
    if is_journal:
        for obj in _read_json_lines(path):
            kind = obj.get("type")
            if kind == "header":
                _enter_boot(records, obj.get("time_boot_ns", 0))
            elif kind == "pg":
                records.groups.setdefault(obj["name"], obj)
            elif kind == "entry":
                records.entries.setdefault(obj["record_id"], obj)
            elif kind == "done" and obj.get("record_id") in records.entries:
                records.entries[obj["record_id"]].update({k: v for k, v in obj.items() if k != "type"})
        return
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return
    if not _enter_boot(records, doc.get("time_boot_ns", 0)):
        return
    for name, pg in doc.get("pg_config", {}).items():
        records.groups.setdefault(name, pg)
    for entry in doc.get("entries", []):
        known = records.entries.get(entry["record_id"])
        if known is None or (entry["state"] in _DONE_STATES and known["state"] not in _DONE_STATES):
            records.entries[entry["record_id"]] = entry
    records.dumps.append({k: doc.get(k) for k in ("reason", "time_dump_ns", "state", "stacks_file")})


def load(dump_dir: str | Path, boot: str | None = None) -> dict[int, RankRecords]:
    """rank -> its records, from the newest boot of each rank (or boot `boot`)."""
    found: dict[tuple[int, str], list[tuple[Path, bool]]] = defaultdict(list)
    boot = None if boot is None else sanitize_id(boot)
    for path in sorted(Path(dump_dir).iterdir()) if Path(dump_dir).is_dir() else ():
        match = NAME_RE.match(path.name)
        if match and (boot is None or match[2] == boot):
            found[(int(match[3]), match[2])].append((path, match[1] == JOURNAL))
    per_rank: dict[int, RankRecords] = {}
    for (rank, boot_id), files in found.items():
        records = RankRecords(rank, boot_id)
        # the rotated journal first (its entries are older), then the journal, then the dumps
        for path, is_journal in sorted(files, key=lambda f: (not f[1], not f[0].name.endswith(".1"), f[0].name)):
            _load_file(records, path, is_journal)
        if rank not in per_rank or records.time_boot_ns > per_rank[rank].time_boot_ns:
            per_rank[rank] = records
    return per_rank


def _pg_label(entry: dict) -> str:
    name, desc = entry["process_group"]
    return desc if desc and desc != "undefined" else name


def _describe(entry: dict) -> str:
    site = entry["frames"][0] if entry.get("frames") else None
    where = f" at {site['filename']}:{site['line']}" if site else ""
    return (f"{_pg_label(entry)} #{entry['collective_seq_id']} {entry['profiling_name']} "
            f"sizes {entry['input_sizes']} {entry['input_dtypes']}{where}")


def _signature(entry: dict) -> str:
    """What must be equal across ranks at one sequence number: op, shapes, dtypes and (SPMD code) the line
    that issued it, which tells apart two same-shaped collectives from different places."""
    site = entry["frames"][0] if entry.get("frames") else {}
    return json.dumps([entry["profiling_name"], entry["input_sizes"], entry["input_dtypes"],
                       site.get("filename"), site.get("line")])


def _members(ranks: dict[int, RankRecords], pg: str, by_rank: dict[int, dict]) -> set[int]:
    members = set(by_rank)
    for records in ranks.values():
        text = records.groups.get(pg, {}).get("ranks", "None")
        if text not in (None, "None"):
            members |= set(ast.literal_eval(text))
    return members


def _rank_evidence(records: RankRecords) -> str:
    line = f"rank {records.rank} (boot {records.boot_id}):"
    last = records.last("collective")
    if last is None:
        line += " no collective recorded"
    else:
        line += f" last collective {_describe(last)}, {last['state']}"
        if last["state"] == "scheduled":
            line += f" (waiting {(records.latest_ns - last['time_created_ns']) / 1e9:.2f}s by its last record)"
        elif last.get("error"):
            line += f" ({last['error']})"
    step = records.last("step")
    if step is not None:
        line += f"; last engine step {step.get('info', {}).get('step')} {step['state']}"
    reasons = [d["reason"] for d in records.dumps]
    return line + (f"; dumps: {reasons}" if reasons else "; no dump (killed, or never dumped)")


def analyze(dump_dir: str | Path, boot: str | None = None) -> Verdict:
    ranks = load(dump_dir, boot)
    if not ranks:
        return Verdict("no_data", f"no flight recorder files in {dump_dir}" + (f" for boot {boot}" if boot else ""))
    by_pg: dict[str, dict[int, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))  # pg -> rank -> seq -> e
    for rank, records in ranks.items():
        for entry in records.entries.values():
            if entry.get("kind", "collective") == "collective":
                by_pg[entry["process_group"][0]][rank][entry["collective_seq_id"]] = entry
    verdict = _mismatch(by_pg) or _missing(ranks, by_pg) or Verdict(
        "stopped", "no rank waits in a collective that others missed; where each rank stopped is below.")
    verdict.ranks = ranks
    verdict.evidence += [_rank_evidence(ranks[rank]) for rank in sorted(ranks)]
    return verdict


def _mismatch(by_pg) -> Verdict | None:
    found = []
    for by_rank in by_pg.values():
        for seq in sorted(set().union(*(d.keys() for d in by_rank.values()))):
            present = {rank: d[seq] for rank, d in by_rank.items() if seq in d}
            signatures = {rank: _signature(entry) for rank, entry in present.items()}
            if len(set(signatures.values())) > 1:
                found.append((min(e["time_created_ns"] for e in present.values()), seq, present, signatures))
                break  # after the first mismatch of a group the pairing means nothing
    if not found:
        return None
    _, seq, present, signatures = min(found, key=lambda f: f[0])
    counts = Counter(signatures.values())
    top = max(counts.values())
    reference = signatures[min(r for r, s in signatures.items() if counts[s] == top)]
    culprits = tuple(sorted(r for r, s in signatures.items() if s != reference))
    agreeing = tuple(sorted(r for r, s in signatures.items() if s == reference))
    ref_entry, bad_entry = present[agreeing[0]], present[culprits[0]]
    tie = " (a tie: rank 0 is the reference)" if counts[reference] * 2 <= len(signatures) else ""
    headline = (f"rank(s) {list(culprits)} issued {bad_entry['profiling_name']} {bad_entry['input_sizes']} "
                f"{bad_entry['input_dtypes']} as collective #{seq} of process group '{_pg_label(ref_entry)}', where "
                f"rank(s) {list(agreeing)} issued {ref_entry['profiling_name']} {ref_entry['input_sizes']} "
                f"{ref_entry['input_dtypes']}{tie}.")
    evidence = [f"rank {rank}: {_describe(present[rank])}, {present[rank]['state']}" for rank in sorted(present)]
    return Verdict("mismatch", headline, culprits, _pg_label(ref_entry), seq, ref_entry["profiling_name"],
                   agreeing, evidence)


def _missing(ranks: dict[int, RankRecords], by_pg) -> Verdict | None:
    waiting: dict[tuple[str, int], list[int]] = defaultdict(list)
    for rank, records in ranks.items():
        last = records.last("collective")
        if last is not None and last["state"] != "completed":
            waiting[(last["process_group"][0], last["collective_seq_id"])].append(rank)
    if not waiting:
        return None
    candidates = []
    for (pg, seq), waiters in waiting.items():
        by_rank = by_pg[pg]
        missing = sorted(m for m in _members(ranks, pg, by_rank)
                         if seq not in by_rank.get(m, {}) and max(by_rank.get(m, {}), default=-1) < seq)
        candidates.append((bool(missing), len(waiters), -min(waiters), pg, seq, sorted(waiters), missing))
    has_missing, _, _, pg, seq, waiters, missing = max(candidates)
    entry = by_pg[pg][waiters[0]][seq]
    what = f"collective #{seq} of process group '{_pg_label(entry)}' ({entry['profiling_name']} {entry['input_sizes']})"
    if not has_missing:
        return Verdict("stuck", f"every member issued {what}, yet rank(s) {waiters} never saw it complete: the "
                       "transport stalled or a peer died inside it.", (), _pg_label(entry), seq,
                       entry["profiling_name"], tuple(waiters))
    evidence = []
    for rank in missing:
        records, on_pg = ranks.get(rank), by_pg[pg].get(rank, {})
        if records is None:
            evidence.append(f"rank {rank}: left no records at all")
            continue
        last_on_pg = on_pg[max(on_pg)] if on_pg else None
        now = records.last("collective")
        evidence.append(f"rank {rank}: never issued #{seq}; on this group it last issued "
                        + (f"#{last_on_pg['collective_seq_id']} ({last_on_pg['state']})" if last_on_pg else "nothing")
                        + (f"; it waits in {_describe(now)} instead" if now and now["state"] != "completed"
                           else "; no collective in flight: it exited, or is stuck outside collectives"))
    headline = f"rank(s) {missing} never issued {what}; rank(s) {waiters} are waiting in it."
    return Verdict("missing", headline, tuple(missing), _pg_label(entry), seq, entry["profiling_name"],
                   tuple(waiters), evidence)


def export_torch(dump_dir: str | Path, out_dir: str | Path, boot: str | None = None) -> list[Path]:
    """Write each rank's merged records as PyTorch flight recorder dumps (`<out_dir>/tandem_fr_torch_<rank>`, pickled
    as torch writes them), so `python -m torch.distributed.flight_recorder.fr_trace OUT_DIR -p tandem_fr_torch_`
    gives its own analysis (of gloo entries from PyTorch 2.13 on). Engine steps and the "engine" pseudo group are
    left out."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank, records in sorted(load(dump_dir, boot).items()):
        entries = sorted((e for e in records.entries.values() if e.get("kind", "collective") == "collective"),
                         key=lambda e: e["record_id"])
        pg_config = {name: {k: pg[k] for k in ("name", "desc", "ranks")}
                     for name, pg in records.groups.items() if pg.get("ranks") not in (None, "None")}
        paths.append(out_dir / f"tandem_fr_torch_{rank}")
        paths[-1].write_bytes(pickle.dumps({"version": TORCH_FR_VERSION, "pg_config": pg_config, "pg_status": {},
                                            "entries": entries}))
    return paths


def main(argv: list[str] | None = None) -> int:
    """`tandem analyze DUMP_DIR [--boot ID]`: prints the verdict, then the evidence. Exit status: 0 when no rank
    waits on another (kind "stopped"), 1 when a hang or mismatch is found, 2 when there is nothing to read."""
    parser = argparse.ArgumentParser(prog="tandem analyze", description=__doc__.split("\n\n")[0])
    parser.add_argument("dump_dir", help="the directory the ranks' flight recorders wrote to")
    parser.add_argument("--boot", help="analyze this boot id (default: each rank's newest)")
    args = parser.parse_args(argv)
    if not Path(args.dump_dir).is_dir():
        print(f"tandem analyze: {args.dump_dir} is not a directory")
        return 2
    verdict = analyze(args.dump_dir, args.boot)
    print(verdict.text())
    return {"stopped": 0, "no_data": 2}.get(verdict.kind, 1)
