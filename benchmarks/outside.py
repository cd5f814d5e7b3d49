"""What the soak sees of the processes it tests, from outside: processes in /proc (children, listening ports, RSS)
and the engine's HTTP server (its stats, and the hostile requests it must refuse)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import time
from pathlib import Path

MAX_BODY_BYTES = 64 << 20  # the engine server's default limit

# ---- processes, from /proc ----------------------------------------------------------------------------------
def children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # a thread that just ended
            kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def listening_ports(pid: int) -> list[int]:
    """The local TCP ports `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                ports.append(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


# ---- HTTP against the engine ----------------------------------------------------------------------------------
def request(port: int, method: str, path: str, body=None, timeout_s: float = 30.0) -> tuple[int, bytes]:
    """(status, body); a dict body is sent as JSON, bytes as they are, an iterator chunked. Status 0: the
    connection failed before a response came."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused before it read the whole body
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException):
        return 0, b""
    finally:
        conn.close()


def engine_stats(port: int) -> dict | None:
    status, data = request(port, "GET", "/engine_stats", timeout_s=10)
    return json.loads(data) if status == 200 else None


def find_engine(trainer_pid: int) -> tuple[int, int] | None:
    """(pid, port) of the engine a `tandem run` with placement=separate started, or None while it has none."""
    for pid in children(trainer_pid):
        for port in listening_ports(pid):
            if (stats := engine_stats(port)) is not None and "pages_total" in stats:
                return pid, port
    return None


def hostile_requests() -> list[tuple[str, str, object]]:
    """(method, path, body) that a correct server refuses with a 4xx and survives."""
    def gen(ids=(1, 2, 3), **sampling):
        return {"input_ids": list(ids), "sampling_params": {"max_new_tokens": 4, **sampling}}
    bad_params = [dict(temperature=-1.0), dict(top_p=2.0), dict(max_new_tokens=-5), dict(top_k=2**40),
                  dict(min_p=1.5), dict(seed=-1), dict(stop_token_ids=[-1]), dict(max_new_tokens="8")]
    bad_ids = [[10**12], [-1], [2**63], [], [1] * 100_000]
    malformed = [b'{"input_ids": [1, 2', b"\xff\xfe", b"[]", b"null", b'{"input_ids": [1], "bogus": 1}',
                 b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', b'{"input_ids": [[1, 2], []]}']
    oversized = [b"0" * (MAX_BODY_BYTES + 1), (b"0" * (1 << 20) for _ in range((MAX_BODY_BYTES >> 20) + 1))]
    return ([("POST", "/generate", gen(**p)) for p in bad_params] + [("POST", "/generate", gen(ids)) for ids in bad_ids]
            + [("POST", "/generate", b) for b in malformed + oversized]
            + [("POST", "/pause_generation", {"mode": "sideways"}), ("POST", "/abort_request", {"rid": 5}),
               ("POST", "/update_weights_from_disk", {"model_path": "/etc"}), ("GET", "/no_such_route", None)])
