"""What the host operations on a KV transfer's way cost warm and just after the thread woke from sleep.

A decode server's thread sleeps in its event loop until the prefill server's ready mail lands, then runs the pass's
host work. On a virtual machine a thread that slept finds its caches cold, and every operation costs many times what
it costs in a loop. This prints, per operation, the median of `--reps` calls: back to back ("warm"), each after a
sleep of `--sleep-ms` ("after sleep"), and each after that sleep and a busy spin of `--spin-ms` (which does not warm
what the operation touches). The doorbell (`tandem.engine.doorbell`) takes these operations off the transfer's way.

    python benchmarks/cold_host_ops.py [--reps 30] [--sleep-ms 20] [--spin-ms 0.2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.engine.kv_index_sums import canonical
from tandem.engine.kv_shared import transfer_stream


def operations(device: torch.device) -> dict:
    """The operations timed, by name: each a call with no argument."""
    stream = torch.cuda.current_stream(device)
    ready, done = torch.cuda.Event(), torch.cuda.Event()
    ready.record(stream)
    host = torch.zeros((2, 512, 2), dtype=torch.int64, pin_memory=True)
    words = host.numpy()
    x = torch.zeros(1 << 20, device=device)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        x.mul_(2)
        torch.cuda.synchronize(device)
        graph.capture_begin(capture_error_mode="thread_local")
        x.add_(1)
        graph.capture_end()

    def wait_on_transfer_stream():
        with transfer_stream(device) as s:
            s.wait_event(ready)

    def the_way():  # (roughly the default way's: the stream, a wait, a replay, an event, the sums read)
        with transfer_stream(device) as s:
            s.wait_event(ready)
            graph.replay()
            done.record(s)
        done.synchronize()
        return canonical(host[:, :512].numpy())

    return {"a timing event made and recorded": lambda: torch.cuda.Event(enable_timing=True).record(stream),
            "transfer_stream entered, an event waited on": wait_on_transfer_stream,
            "a CUDA graph replayed": graph.replay,
            "canonical() of 512 pages' sums": lambda: canonical(host[:, :512].numpy()),
            "a numpy copy of 8 KB": lambda: words[:, :512].copy(),
            "8 KB compared as bytes": lambda: words[0].tobytes() == words[1].tobytes(),
            "all of the above in a row (a small graph)": the_way}


def timed(op, reps: int, sleep_s: float, spin_s: float) -> float:
    """The median seconds of `reps` calls of `op`, each after a sleep (if any) and a spin (if any)."""
    for _ in range(3):
        op()
    times = []
    for _ in range(reps):
        if sleep_s:
            time.sleep(sleep_s)
        end = time.perf_counter() + spin_s
        while time.perf_counter() < end:
            pass
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--sleep-ms", type=float, default=20.0)
    p.add_argument("--spin-ms", type=float, default=0.2)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cold_host_ops: needs a GPU")
    device = torch.device("cuda", 0)
    sleep_s, spin_s = args.sleep_ms / 1e3, args.spin_ms / 1e3
    print(f"## host operations warm and after a sleep ({torch.cuda.get_device_name(device)}, median of "
          f"{args.reps}, us)\n")
    print(f"| operation | warm | after {args.sleep_ms:g} ms asleep | and a {args.spin_ms:g} ms spin |")
    print("|---|---|---|---|")
    for name, op in operations(device).items():
        warm, cold, spun = (timed(op, args.reps, s, w) for s, w in ((0, 0), (sleep_s, 0), (sleep_s, spin_s)))
        print(f"| {name} | {1e6 * warm:,.1f} | {1e6 * cold:,.1f} | {1e6 * spun:,.1f} |")


if __name__ == "__main__":
    main()
