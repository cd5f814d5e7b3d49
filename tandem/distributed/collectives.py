"""Recorded collectives: `torch.distributed` calls wrapped in the process's flight recorder, with the fault hooks.

The tensor-parallel layers and the engine call these instead of `torch.distributed` directly, so that every collective
is in the recorder (seq id, shapes, dtypes, times, calling site) and can be made to misbehave by `faults` in tests.
Blocking calls only (no `async_op`). On NCCL the host call returns once the collective is enqueued, so "completed"
means enqueued there; on gloo it means done.

Collectives captured in a CUDA graph (NCCL) run on every replay without passing through here. So a capture (the
`capturing` block) records nothing and counts them, and each `replay` of the graph is one record on the group, op
"cuda_graph" with the graph's batch size as its input shape and the count in its `info`; the fault plan applies to
that record (a skipped replay skips every collective in the graph, as a diverged rank would).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from tandem.distributed import faults
from tandem.distributed.flight_recorder import FlightRecorder

_recorder: FlightRecorder | None = None
_capture = threading.local()  # .ops: the ops issued in this thread's CUDA graph capture under way, if one is


def set_recorder(recorder: FlightRecorder | None) -> FlightRecorder | None:
    """Make `recorder` the one the collectives below record into; returns the previous one."""
    global _recorder
    previous, _recorder = _recorder, recorder
    return previous


def get_recorder() -> FlightRecorder:
    """The process's recorder; a memory-only one until `set_recorder` is called."""
    global _recorder
    if _recorder is None:
        _recorder = FlightRecorder(dist.get_rank() if dist.is_initialized() else 0)
    return _recorder


def _issue(op: str, group, inputs, outputs, call: Callable[[], object], info: dict | None = None):
    """Record `call` as `op` on `group`, unless the fault plan makes this rank skip it (then nothing is recorded)."""
    ops = getattr(_capture, "ops", None)
    if ops is not None:
        ops.append(op)
        return call()
    recorder = get_recorder()
    pg = recorder.group_info(group)
    if faults.before_collective(recorder.rank, (pg["name"], pg["desc"]), recorder.next_seq(group)):
        return None
    with recorder.recorded(group, op, inputs, outputs, info=info):
        return call()


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None):
    return _issue("all_reduce", group, [tensor], [tensor], lambda: dist.all_reduce(tensor, op=op, group=group))


def broadcast(tensor: torch.Tensor, src: int, group=None):
    return _issue("broadcast", group, [tensor], [tensor], lambda: dist.broadcast(tensor, src=src, group=group))


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None):
    return _issue("all_gather", group, [tensor], tensor_list,
                  lambda: dist.all_gather(tensor_list, tensor, group=group))


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group=None):
    """Every rank's `tensor` (the same size on each), end to end in rank order, into `output` (flat)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the name before torch 2.13)
    return _issue("all_gather_single", group, [tensor], [output], lambda: gather(output, tensor, group=group))


def barrier(group=None):
    return _issue("barrier", group, [], [], lambda: dist.barrier(group=group))


@contextlib.contextmanager
def capturing() -> Iterator[list[str]]:
    """Around a CUDA graph capture: the collectives issued inside are not recorded; yields their ops, in order."""
    if getattr(_capture, "ops", None) is not None:
        raise RuntimeError("collectives: captures do not nest")
    _capture.ops = ops = []
    try:
        yield ops
    finally:
        _capture.ops = None


def replay(graph: torch.cuda.CUDAGraph, batch_size: int, ops: list[str], group=None) -> None:
    """Replay `graph`, captured with `ops` on `group`, as one record (see the module docstring)."""
    if not ops:
        graph.replay()
        return
    shape = [torch.empty(batch_size, device="meta")]
    _issue("cuda_graph", group, shape, shape, graph.replay, {"batch_size": batch_size, "collectives": len(ops)})
