"""Flight recorder: per rank, an always-on ring of the last `capacity` collectives and engine steps, journaled to disk.

Each record goes into an in-memory ring (dumped on demand) AND into a per-rank journal of JSON lines, flushed per line
(no fsync): it survives the process being killed (SIGKILL, os._exit, a gloo abort), not the machine losing power.
Only host-side metadata is read (shapes, dtypes, times), never tensor values: a dump works while a GPU is hung.

Files in `dump_dir`, named `<kind>.<boot_id>.rank<R>[.<n>].<ext>`. The boot id (argument, else $TANDEM_BOOT_ID, else
a fresh time-pid-random id) makes a restart write new files beside the old boot's instead of over them; give every
rank of one boot the same id so the analyzer can pair their files. Ids are sanitised before they reach a path.
- `tandem_fr.<boot>.rank<R>.jsonl`, the journal. Lines (one JSON object each):
  `{"type": "header", "format", "rank", "world_size", "boot_id", "pid", "host", "time_boot_ns"}` first in every file;
  `{"type": "pg", "name", "desc", "ranks", "backend", "pg_id"}` when a process group is first used;
  `{"type": "entry", <entry fields>}` when a record starts (state "scheduled");
  `{"type": "done", "record_id", "state", "time_discovered_completed_ns", "duration_ms", ["error"]}` when it ends.
  After `capacity` entries the file becomes `....jsonl.1` (replacing the previous one) and a new file begins, so the
  disk holds between `capacity` and 2 x `capacity` entries.
- `tandem_dump.<boot>.rank<R>.<n>.json`, dump number n: `{"format", "version", "rank", "world_size", "boot_id", "pid",
  "host", "time_boot_ns", "reason", "time_dump_ns", "pg_config": {name: {"name", "desc", "ranks"}}, "entries": [the
  ring, oldest first], "state": {provider: value}, "stacks_file"}`; written to a temporary file, then renamed.
- `tandem_stacks.<boot>.rank<R>.<n>.txt` and `tandem_fatal.<boot>.rank<R>.txt`: thread stacks, from `watchdog`.

Entry fields use PyTorch's flight recorder names: `record_id`, `pg_id`, `process_group` [name, desc],
`collective_seq_id` (per process group, from 0), `p2p_seq_id` (-1), `op_id`, `profiling_name` ("gloo:all_reduce"),
`input_sizes`, `input_dtypes`, `output_sizes`, `output_dtypes`, `state` (scheduled | completed | failed),
`time_created_ns`, `time_discovered_started_ns`, `time_discovered_completed_ns`, `duration_ms`, `retired`, `is_p2p`,
`frames` ([{name, filename, line}], the calling site outside this package first); and tandem's own: `kind`
(collective | step), `info` (an engine step's fields), `error` (a failed record's exception).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

FORMAT = "tandem-fr-1"
TORCH_FR_VERSION = "2.10"  # the PyTorch flight recorder dump version whose field names the entries follow
JOURNAL, DUMP, STACKS, FATAL = "tandem_fr", "tandem_dump", "tandem_stacks", "tandem_fatal"
ENGINE_GROUP = "engine"  # the pseudo process group of engine-step records
NUM_FRAMES = 3
MAX_ID_LEN = 48
# the calling site is the first frame outside this package, contextlib and torch (whose module call wraps
# every layer): in SPMD code it names the line that issued the collective, the same on every rank
_SKIP_FILES = (os.path.dirname(os.path.abspath(__file__)) + os.sep, contextlib.__file__)
_SKIP_PARTS = (f"{os.sep}torch{os.sep}nn{os.sep}",)


def sanitize_id(value: object, max_len: int = MAX_ID_LEN) -> str:
    """A file-name-safe form of `value`: only [A-Za-z0-9_-], never empty, at most `max_len` characters. An id that
    had to change gets a hash of the original appended, so two hostile ids cannot collide on one name."""
    text = str(value)
    safe = re.sub(r"[^A-Za-z0-9_-]+", "_", text).strip("_-") or "id"
    if safe == text and len(safe) <= max_len:
        return safe
    digest = hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=4).hexdigest()
    return f"{safe[: max_len - len(digest) - 1]}-{digest}"


def new_boot_id() -> str:
    """Sortable by start time, unique across restarts and hosts' pids."""
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}-{secrets.token_hex(3)}"


def evidence_name(kind: str, boot_id: str, rank: int, index: int | None = None, ext: str = "json") -> str:
    return f"{kind}.{sanitize_id(boot_id)}.rank{int(rank)}{'' if index is None else f'.{int(index)}'}.{ext}"


def to_jsonable(obj: object) -> object:
    """`json.dumps` default: tensors become metadata (values only for small CPU tensors: reading device memory
    would sync, and hang with a hung device), dataclasses shallow dicts, anything else its repr."""
    if isinstance(obj, torch.Tensor):
        out = {"shape": list(obj.shape), "dtype": str(obj.dtype), "device": str(obj.device)}
        if obj.device.type == "cpu" and obj.numel() <= 64:
            out["values"] = obj.tolist()
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, set | frozenset):
        return sorted(obj, key=repr)
    return repr(obj)


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"), default=to_jsonable)


def _calling_frames(limit: int = NUM_FRAMES) -> list[dict]:
    frames, frame = [], sys._getframe(1)
    while frame is not None and len(frames) < limit:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIP_FILES) and not any(part in filename for part in _SKIP_PARTS):
            frames.append({"name": frame.f_code.co_name, "filename": filename, "line": frame.f_lineno})
        frame = frame.f_back
    return frames


class FlightRecorder:
    """The recorder of one rank. Thread-safe. `dump_dir=None` keeps records in memory only; `journal=False` writes
    dumps but no journal. Recording costs one JSON line write per start and per end (no fsync)."""

    def __init__(self, rank: int, dump_dir: str | os.PathLike | None = None, *, capacity: int = 2000,
                 boot_id: str | None = None, world_size: int | None = None, journal: bool = True):
        if int(rank) < 0:
            raise ValueError(f"flight recorder: rank must be >= 0, got {rank}")
        if capacity < 1:
            raise ValueError(f"flight recorder: capacity must be >= 1, got {capacity}")
        self.rank, self.capacity = int(rank), capacity
        self.boot_id = sanitize_id(boot_id or os.environ.get("TANDEM_BOOT_ID") or new_boot_id())
        self.dump_dir = None if dump_dir is None else Path(dump_dir)
        self._ring: deque[dict] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._next_record_id = 0
        self._next_index: dict[str, int] = {}  # file kind -> its next dump number
        self._next_seq: dict[str, int] = {}  # process group name -> its next collective_seq_id
        self._groups: dict[str, dict] = {}  # process group name -> its "pg" line
        self.header = {"type": "header", "format": FORMAT, "rank": self.rank, "world_size": world_size,
                       "boot_id": self.boot_id, "pid": os.getpid(), "host": socket.gethostname(),
                       "time_boot_ns": time.time_ns()}
        self.journal_path = None
        self._journal, self._journal_entries = None, 0
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            if journal:
                self.journal_path = self.path(JOURNAL, ext="jsonl")
                self._open_journal()

    def path(self, kind: str, index: int | None = None, ext: str = "json") -> Path:
        assert self.dump_dir is not None, "a memory-only recorder has no files"
        return self.dump_dir / evidence_name(kind, self.boot_id, self.rank, index, ext)

    def reserve_path(self, kind: str, ext: str = "json") -> Path:
        """The next numbered path of `kind` in this boot; never an existing file, even if a boot id was reused."""
        with self._lock:
            index = self._next_index.get(kind, 0)
            while (path := self.path(kind, index, ext)).exists():
                index += 1
            self._next_index[kind] = index + 1
        return path

    # --- recording -------------------------------------------------------------------------------------------------
    def group_info(self, group: dist.ProcessGroup | str | None) -> dict:
        """The "pg" line of `group` (None: the default group; a str: a pseudo group with no ranks)."""
        if isinstance(group, str):
            name, desc = group, group
        else:
            group = group if group is not None else dist.group.WORLD
            name, desc = group.group_name, group.group_desc
        info = self._groups.get(name)
        if info is None:
            ranks = None if isinstance(group, str) else dist.get_process_group_ranks(group)
            backend = group if isinstance(group, str) else str(dist.get_backend(group))
            with self._lock:
                if name not in self._groups:
                    self._groups[name] = {"type": "pg", "name": name, "desc": desc, "ranks": str(ranks),
                                          "backend": backend, "pg_id": len(self._groups)}
                    self._write(self._groups[name])
                info = self._groups[name]
        return info

    def next_seq(self, group: dist.ProcessGroup | str | None) -> int:
        return self._next_seq.get(self.group_info(group)["name"], 0)

    @contextlib.contextmanager
    def recorded(self, group: dist.ProcessGroup | str | None, op: str, inputs: Sequence[torch.Tensor] = (),
                 outputs: Sequence[torch.Tensor] | None = None, *, kind: str = "collective",
                 info: dict | None = None, frames: bool = True) -> Iterator[dict]:
        """Record the block as one `op` on `group`: "scheduled" on entry, "completed" on exit, "failed" (with the
        error) when it raises. Yields the entry. For blocking calls only: an async work handle would complete later.
        `frames`: with the caller's stack (False: the call site never varies and the walk is not worth its cost)."""
        entry = self._begin(group, op, inputs, inputs if outputs is None else outputs, kind, info, frames)
        try:
            yield entry
        except BaseException as e:
            self._end(entry, "failed", f"{type(e).__name__}: {e}")
            raise
        self._end(entry, "completed")

    def engine_step(self, step: int, **info) -> contextlib.AbstractContextManager[dict]:
        """Record one engine step (`info`: small JSON-able fields, e.g. batch size) on the pseudo group "engine"."""
        return self.recorded(ENGINE_GROUP, "step", kind="step", info={"step": step, **info}, frames=False)

    def _begin(self, group, op, inputs, outputs, kind, info, frames: bool = True) -> dict:
        pg, frames, now = self.group_info(group), _calling_frames() if frames else [], time.time_ns()
        with self._lock:
            seq = self._next_seq.get(pg["name"], 0)
            self._next_seq[pg["name"]] = seq + 1
            entry = {"type": "entry", "record_id": self._next_record_id, "pg_id": pg["pg_id"],
                     "process_group": [pg["name"], pg["desc"]], "collective_seq_id": seq, "p2p_seq_id": -1,
                     "op_id": seq, "profiling_name": f"{pg['backend']}:{op}", "kind": kind,
                     "input_sizes": [list(t.shape) for t in inputs],
                     "input_dtypes": [str(t.dtype).removeprefix("torch.") for t in inputs],
                     "output_sizes": [list(t.shape) for t in outputs],
                     "output_dtypes": [str(t.dtype).removeprefix("torch.") for t in outputs],
                     "state": "scheduled", "time_created_ns": now, "time_discovered_started_ns": now,
                     "time_discovered_completed_ns": None, "duration_ms": None, "retired": False, "is_p2p": False,
                     "frames": frames}
            if info is not None:
                entry["info"] = info
            self._next_record_id += 1
            self._ring.append(entry)
            if self._journal is not None and self._journal_entries >= self.capacity:
                self._rotate()
            self._journal_entries += 1
            self._write(entry)
        return entry

    def _end(self, entry: dict, state: str, error: str | None = None) -> None:
        now = time.time_ns()
        with self._lock:
            entry.update(state=state, time_discovered_completed_ns=now, retired=True,
                         duration_ms=(now - entry["time_created_ns"]) / 1e6)
            done = {"type": "done", "record_id": entry["record_id"], "state": state,
                    "time_discovered_completed_ns": now, "duration_ms": entry["duration_ms"]}
            if error is not None:
                entry["error"] = done["error"] = error[:500]
            self._write(done)

    # --- journal (callers hold the lock) ---------------------------------------------------------------------------
    def _open_journal(self) -> None:
        self._journal = open(self.journal_path, "a", encoding="utf-8")  # noqa: SIM115 (lives as long as we do)
        self._journal_entries = 0
        for line in (self.header, *self._groups.values()):
            self._write(line)

    def _rotate(self) -> None:
        self._journal.close()
        try:
            os.replace(self.journal_path, f"{self.journal_path}.1")
            self._open_journal()
        except OSError as e:
            self._disable_journal(e)

    def _write(self, obj: dict) -> None:
        if self._journal is None:
            return
        try:
            self._journal.write(_dumps(obj) + "\n")
            self._journal.flush()
        except OSError as e:
            self._disable_journal(e)

    def _disable_journal(self, error: OSError) -> None:
        # a full disk must not stop the engine: lose the journal, keep the ring and the dumps
        print(f"flight recorder: journal {self.journal_path} disabled: {error}", file=sys.stderr)
        self._journal = None

    # --- dumps -----------------------------------------------------------------------------------------------------
    def entries(self) -> list[dict]:
        with self._lock:
            return [dict(entry) for entry in self._ring]

    def snapshot(self, reason: str, state: dict | None = None, stacks_file: str | None = None) -> dict:
        with self._lock:
            entries = [dict(entry) for entry in self._ring]
            pg_config = {name: {"name": pg["name"], "desc": pg["desc"], "ranks": pg["ranks"]}
                         for name, pg in self._groups.items() if pg["ranks"] != "None"}  # not the "engine" pseudo group
        return {**{k: v for k, v in self.header.items() if k != "type"}, "version": TORCH_FR_VERSION,
                "reason": reason, "time_dump_ns": time.time_ns(), "pg_config": pg_config, "entries": entries,
                "state": state or {}, "stacks_file": stacks_file}

    def dump(self, reason: str, state: dict | None = None, stacks_file: str | None = None) -> Path | None:
        """Write dump number n (0, 1, ...) of this boot; never overwrites. Returns its path, None when memory-only."""
        doc = self.snapshot(reason, state, stacks_file)
        if self.dump_dir is None:
            return None
        path = self.reserve_path(DUMP)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=to_jsonable), encoding="utf-8")
        os.replace(tmp, path)
        return path

    def close(self) -> None:
        with self._lock:
            if self._journal is not None:
                self._journal.close()
                self._journal = None
