"""The KV transfer point to point (`tandem.engine.kv_transfer`'s third way): a prefill server sends an export's
keys and values [2, L, T, K, D] to a decode server over a torch.distributed group of their own, two ranks (the
prefill server 0, the decode server 1): gloo between CPUs, NCCL between GPUs. NCCL cannot put two ranks on one GPU,
so two servers sharing a GPU take KV by reference (CUDA IPC) instead (`why_not_p2p`).

The pairing (`tandem.server.disagg`): the decode server asks the prefill server to open a link; the prefill server
hosts the rendezvous (a `TCPStore` on a port of its choosing) and both build their end (`P2PLink`, blocking until
both have joined, at most the timeout). A transfer: the prefill server answers `/pd/prefill` with the KV's header
(shape, dtype, checksums, routing) and holds the export; the decode server, its link's turn taken (one transfer at
a time a link, so sends and receives pair in order, as NCCL needs), starts receiving into a buffer of its own and
asks the prefill server to send; both wait at most the timeout. What was received is verified on the receiver's
device before anything is written. A failed or timed-out send or receive breaks the link at both ends (the group
is aborted, and the buffers it may still touch are kept, never freed while a transfer might touch them); the
decode server's request then ends with an abort, and its next request opens a new link.
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tandem.engine.kv_shared import _gpu_uuid, kv_header, transfer_stream
from tandem.transport.dist import rendezvous

if TYPE_CHECKING:
    from tandem.engine.kv_transfer import KVPages

P2P_TIMEOUT_S = 30.0  # a link's rendezvous, and each send or receive, fail after this long
POLL_S = 2e-4  # how often a wait for NCCL polls (its own wait with a timeout sleeps in steps of a millisecond)


def backend_for(device: torch.device | str) -> str | None:
    """The torch.distributed backend for KV on `device` ("gloo" on a CPU, "nccl" on a GPU), None if none here."""
    kind = torch.device(device).type
    if kind == "cpu" and dist.is_available() and dist.is_gloo_available():
        return "gloo"
    if kind == "cuda" and dist.is_available() and dist.is_nccl_available():
        return "nccl"
    return None


def why_not_p2p(theirs: dict, device: torch.device | str) -> str | None:
    """Why this process cannot receive into `device`, point to point, KV from a process whose
    `kv_shared.sharing_domain` is `theirs`; None if it can."""
    device = torch.device(device)
    if theirs.get("device") != device.type:
        return f"its KV is on a {theirs.get('device')} device, this server's on a {device.type} device"
    if backend_for(device) is None:
        return f"this torch has no point-to-point backend for {device.type} tensors"
    if device.type == "cuda" and theirs.get("gpu") == _gpu_uuid(device):
        return "it shares this server's GPU (NCCL cannot put two ranks on one GPU)"
    return None


class P2PLink:
    """One end of a two-rank group between a prefill server (rank 0, `send`) and a decode server (rank 1, `recv`),
    standalone (not `init_process_group`: it lives beside any group of the process). Building it blocks until the
    other end has joined through `store`, at most `timeout_s`. `send` and `recv` block until the tensor has gone or
    arrived (on a GPU: its device work done), at most `timeout_s`, else raise RuntimeError and break the link:
    every later call refuses at once, naming why."""

    def __init__(self, store: dist.Store, rank: int, device: torch.device | str, timeout_s: float = P2P_TIMEOUT_S):
        self.rank, self.device = rank, torch.device(device)
        self.backend = backend_for(self.device)
        if self.backend is None:
            raise ValueError(f"kv p2p: no backend for {self.device.type} tensors in this torch")
        self.timeout_s, self.timeout = timeout_s, timedelta(seconds=timeout_s)
        self.store = store  # (rank 0's store serves the rendezvous: alive as long as the link)
        self.broken: str | None = None
        self._kept: list[torch.Tensor] = []  # buffers of failed transfers: the group may still touch them
        self._lock = threading.Lock()
        prefixed = dist.PrefixStore("tandem/kv", store)
        if self.backend == "gloo":
            self.group = dist.ProcessGroupGloo(prefixed, rank, 2, self.timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, 2, options)

    def send(self, kv_2LTKD: torch.Tensor) -> None:
        """Send `kv_2LTKD` (contiguous, on this link's device) to the other end."""
        self._run("send", kv_2LTKD, lambda: self.group.send([kv_2LTKD], 1 - self.rank, 0))

    def recv(self, kv_2LTKD: torch.Tensor) -> None:
        """Receive into `kv_2LTKD` (contiguous, on this link's device) what the other end sends."""
        self._run("receive", kv_2LTKD, lambda: self.group.recv([kv_2LTKD], 1 - self.rank, 0))

    def close(self) -> None:
        if self.broken is None:
            self.broken = "closed"
        with contextlib.suppress(Exception):
            self.group.abort()

    def _run(self, what: str, tensor: torch.Tensor, start) -> None:
        if not tensor.is_contiguous() or tensor.device != self.device:
            raise ValueError(f"kv p2p: {what} needs a contiguous tensor on {self.device}, got one on {tensor.device}")
        with self._lock:
            if self.broken is not None:
                raise RuntimeError(f"kv p2p: the link failed before ({self.broken})")
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            try:
                with transfer_stream(self.device):  # (the group's stream syncs with it, not with the engine's)
                    self._wait(start())
            except Exception as e:
                self._kept.append(tensor)
                self.broken = f"{what} of {tensor.numel() * tensor.element_size()} bytes failed or timed out " \
                              f"(timeout {self.timeout_s:g} s): {type(e).__name__}: {e}"
                with contextlib.suppress(Exception):
                    self.group.abort()
                raise RuntimeError(f"kv p2p: {self.broken}") from e

    def _wait(self, work) -> None:
        if self.backend == "gloo":  # (gloo's send and receive complete only inside wait, which takes a timeout)
            if not work.wait(self.timeout):
                raise TimeoutError("not completed")
            return
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError("not completed")
            time.sleep(POLL_S)
        work.wait()
        torch.cuda.current_stream(self.device).synchronize()


class P2PExport:
    """A prefill server's KV held until it is sent point to point: `tensor` its keys and values as one contiguous
    [2, L, T, K, D] tensor on its device, `handle` the header the receiver needs (JSON, `kv_shared.kv_header`).
    `free` drops it (`taken` is ignored: nothing but this process holds it)."""

    def __init__(self, kv: KVPages):
        self.handle = {"kind": "p2p"} | kv_header(kv)
        self.tensor: torch.Tensor | None = kv.stacked()

    def free(self, taken: bool) -> None:
        self.tensor = None


def host_store(timeout_s: float = P2P_TIMEOUT_S) -> dist.TCPStore:
    """A rendezvous store for one link, served by this process on a free port (`.port`), every interface."""
    return rendezvous("0.0.0.0", timeout_s)


def join_store(host: str, port: int, timeout_s: float = P2P_TIMEOUT_S) -> dist.TCPStore:
    """The other end's rendezvous store at `host`:`port`."""
    return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))
