"""A run's checkpoint state copied off the live tensors, where host memory holds the copy.

A step's checkpoint, and the run's last, is written by a thread (`tandem.run.loop.Run`). Its trainer tensors are the
live ones, which the next optimizer step overwrites: copied to host memory first, they may be written while the
trainer goes on; where the copy would not fit, the live tensors are written and the next step waits for the write.
The copy (`Tensor.to`) also lets every other thread run: `torch.save` copies a device tensor's storage to the host
keeping the interpreter's lock throughout, so a colocated engine's thread and the event loop wait on a write of
live device tensors, even from a thread of its own: where the copy does not fit, they do.
"""

from __future__ import annotations

import torch

HOST_SHARE = 0.5  # of the host memory available, at most, for a checkpoint's copy


def tensor_bytes(state) -> int:
    """Bytes of every tensor in `state` (nested dicts, lists and tuples)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(tensor_bytes(v) for v in state)
    return 0


def host_bytes_available() -> int | None:
    """The host memory the kernel says is available (MemAvailable), or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def fits_in_host_memory(state) -> bool:
    """Whether a copy of `state`'s tensors takes at most `HOST_SHARE` of the host memory available now."""
    available = host_bytes_available()
    return available is not None and tensor_bytes(state) <= HOST_SHARE * available


def copied(state):
    """`state` with every tensor copied to host memory (nested dicts, lists and tuples rebuilt, a module state
    dict's `_metadata` kept; everything else as it is)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        copy = type(state)((k, copied(v)) for k, v in state.items())
        if hasattr(state, "_metadata"):  # (the versions a module's loading reads)
            copy._metadata = state._metadata
        return copy
    if isinstance(state, list | tuple):
        return type(state)(copied(v) for v in state)
    return state
