"""Recorded collectives: `torch.distributed` calls wrapped in the process's flight recorder, with the fault hooks.

The tensor-parallel layers and the engine call these instead of `torch.distributed` directly, so that every collective
is in the recorder (seq id, shapes, dtypes, times, calling site) and can be made to misbehave by `faults` in tests.
Blocking calls only (no `async_op`). On NCCL the host call returns once the collective is enqueued, so "completed"
means enqueued there; on gloo it means done.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from tandem.distributed import faults
from tandem.distributed.flight_recorder import FlightRecorder

_recorder: FlightRecorder | None = None


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


def _issue(op: str, group, inputs, outputs, call: Callable[[], object]):
    """Record `call` as `op` on `group`, unless the fault plan makes this rank skip it (then nothing is recorded)."""
    recorder = get_recorder()
    pg = recorder.group_info(group)
    if faults.before_collective(recorder.rank, (pg["name"], pg["desc"]), recorder.next_seq(group)):
        return None
    with recorder.recorded(group, op, inputs, outputs):
        return call()


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None):
    return _issue("all_reduce", group, [tensor], [tensor], lambda: dist.all_reduce(tensor, op=op, group=group))


def broadcast(tensor: torch.Tensor, src: int, group=None):
    return _issue("broadcast", group, [tensor], [tensor], lambda: dist.broadcast(tensor, src=src, group=group))


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None):
    return _issue("all_gather", group, [tensor], tensor_list,
                  lambda: dist.all_gather(tensor_list, tensor, group=group))


def barrier(group=None):
    return _issue("barrier", group, [], [], lambda: dist.barrier(group=group))
