"""Where the engine runs relative to the trainer, and how new weights reach it.

`Colocated`: the engine's thread in the trainer's process (on one GPU they share it); weights handed over in memory
(`InProcessSender`). `Separate`: the engine in a process of its own (`EngineProcess`), driven over its HTTP API
(`EngineClient`). Its weights, by `RunConfig.weight_transport`:
- "group": broadcast SGLang-style over a torch.distributed group (NCCL on CUDA, gloo on CPU): the trainer has the
  engine join with `/init_weights_update_group` once, then per update calls `/update_weights_from_distributed`
  while its `DistSender` broadcasts the buckets (pipelined, see `tandem.transport.dist`). Never a call per tensor.
- "ipc" (the default when both share one GPU, where NCCL cannot run two ranks): the trainer's tensors go to the
  engine's process by reference through the pipe that spawned it (CUDA IPC handles, or shared memory on a CPU),
  and the engine copies them in during its pause (`EngineProcess.load_weights`).

In both, what excludes generation is only the load: the engine receives the new weights into a staging copy while
it keeps generating, then pauses (the run's pause mode), copies the staging tensors into its parameters
(`Engine.update_weights`), and resumes. `SyncStats` measures the transfer and that pause separately.
"""

from __future__ import annotations

import abc
import asyncio
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NoReturn

import torch

from tandem.config import RunConfig, resolve_model
from tandem.engine.client import EngineClient, EngineUnreachable
from tandem.engine.engine import Engine, EngineError
from tandem.run.engine_process import EngineProcess
from tandem.transport.dist import DistSender
from tandem.transport.weights import InProcessReceiver, InProcessSender, TransportError, validated

NamedTensors = Iterable[tuple[str, torch.Tensor]]
MONITOR_S = 1.0  # how often the monitor looks at the engine
GROUP = "tandem-weights"


@dataclass(frozen=True, slots=True)
class SyncStats:
    """One weight sync. `transfer_s`: the trainer's send, until every engine holds a full copy (the engine keeps
    generating meanwhile; with weight transport "ipc", handing over the references: `sync_s - pause_s`);
    `pause_s`: generation excluded (pause, load into the parameters, resume); `sync_s`: the whole sync as the
    trainer waited for it."""

    transfer_s: float
    pause_s: float
    sync_s: float
    num_bytes: int
    wait_s: float = 0.0  # of transfer_s: until the engine started receiving (its HTTP call arriving)
    receive_s: float | None = None  # the engine's side of the transfer (its hello to its last bucket), where known
    receive_phases: dict | None = None  # where the engine's side went (`TransferStats.phases`), where known
    send_phases: dict | None = None  # where the trainer's side went, where known
    load_s: float | None = None  # the engine's load: its pause and its wait for the engine's thread, where known

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0


class Placement(abc.ABC):
    """`engine`: what the rollout manager and the run loop drive (the `Engine`, or an `EngineClient` of one)."""

    engine: Engine | EngineClient

    @abc.abstractmethod
    async def start(self, named_weights: NamedTensors, version: int) -> SyncStats:
        """Connect the weight transport and push the trainer's weights as `version` (so both sides start from the
        same weights, whatever device drew them). Call once, before anything generates."""

    @abc.abstractmethod
    async def push(self, named_weights: NamedTensors, version: int) -> SyncStats:
        """Make the engine hold `named_weights` as `version`; returns once it does. Reads the tensors only before
        it returns. Raises (naming the engine) when the transfer fails; the run cannot continue after that."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raise if the engine is gone (its thread or process ended)."""

    async def monitor(self) -> NoReturn:
        """Never returns; raises once the engine is gone."""
        while True:
            await asyncio.sleep(MONITOR_S)
            self.check()

    async def disconnect(self) -> None:  # noqa: B027 (most placements hold nothing per event loop)
        """Release what the current event loop holds (connections)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and the transport."""


class Colocated(Placement):
    def __init__(self, cfg: RunConfig):
        self.engine = Engine(cfg.model, cfg.engine, dtype=cfg.engine_dtype, seed=cfg.seed)
        self.receiver = InProcessReceiver(cfg.weight_sync_timeout_s)
        self.sender = InProcessSender(self.receiver, cfg.weight_sync_timeout_s)
        self.pause_mode = cfg.rollout.pause_mode

    async def start(self, named_weights: NamedTensors, version: int) -> SyncStats:
        return await self.push(named_weights, version)

    async def push(self, named_weights: NamedTensors, version: int) -> SyncStats:
        t0 = time.perf_counter()
        received = asyncio.create_task(asyncio.to_thread(self.receiver.receive))
        transfer = await asyncio.to_thread(self.sender.send, named_weights, version)
        version, tensors = await received
        pause_s = await self.engine.load_paused(tensors, version, self.pause_mode)
        return SyncStats(transfer.seconds, pause_s, time.perf_counter() - t0, transfer.num_bytes)

    def check(self) -> None:
        if not self.engine.is_alive():
            raise EngineError("engine thread stopped")

    def shutdown(self) -> None:
        self.engine.shutdown()


class Separate(Placement):
    """The engine's process listens on 127.0.0.1; the trainer hosts the weight group's store on a free local port.
    The monitor also fails when the engine leaves `/health` unanswered for `engine_timeout_s` (stopped or stuck)."""

    def __init__(self, cfg: RunConfig):
        resolve_model(cfg.model)  # a bad model name is a ValueError here, not a failed child
        self.cfg = cfg
        self.device = cfg.trainer_device or cfg.engine.device
        self.backend = "nccl" if self.device.startswith("cuda") else "gloo"
        self.sender: DistSender | None = None
        self.ipc = cfg.resolved_weight_transport == "ipc"
        self.process = EngineProcess(cfg.model, cfg.engine, cfg.seed, cfg.engine_timeout_s, cfg.engine_dtype,
                                     share_gpu=self.ipc)
        try:
            self.engine = EngineClient(self.process.url, cfg.engine_timeout_s).connect()
        except BaseException:
            self.process.stop()
            raise

    async def start(self, named_weights: NamedTensors, version: int) -> SyncStats:
        if self.ipc:
            return await self.push(named_weights, version)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        timeout_s = self.cfg.weight_sync_timeout_s
        joined = self.engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, self.backend, timeout_s)
        sender = asyncio.to_thread(DistSender, f"tcp://127.0.0.1:{port}", 2, 0, self.backend, timeout_s,
                                   self.cfg.weight_bucket_bytes, f"trainer pid {os.getpid()}",
                                   self.device if self.backend == "nccl" else None)
        self.sender, _ = await self._both(sender, joined, "joining the weight group")
        return await self.push(named_weights, version)

    async def push(self, named_weights: NamedTensors, version: int) -> SyncStats:
        t0 = time.perf_counter()
        if self.ipc:
            named = [(name, tensor.detach()) for name, tensor in validated(named_weights)]
            try:
                pause_s = await asyncio.to_thread(self.process.load_weights, named, version,
                                                  self.cfg.rollout.pause_mode, self.cfg.weight_sync_timeout_s)
            except (ValueError, EngineUnreachable) as e:
                raise TransportError(f"weight sync of version {version} failed: {e}", ranks=(1,)) from e
            self.engine.weight_version = version  # what the group route's reply sets on the client
            sync_s = time.perf_counter() - t0
            return SyncStats(sync_s - pause_s, pause_s, sync_s, sum(t.numel() * t.element_size() for _, t in named))
        sent = asyncio.to_thread(self.sender.send, named_weights, version)
        loaded = self.engine.update_weights_from_distributed(GROUP, version, self.cfg.rollout.pause_mode)
        transfer, reply = await self._both(sent, loaded, f"weight sync of version {version}")
        return SyncStats(transfer.seconds, reply["pause_s"], time.perf_counter() - t0, transfer.num_bytes,
                         transfer.wait_s, reply["transfer_s"], reply.get("receive_phases"), transfer.phases,
                         reply.get("load_s"))

    async def _both(self, trainer_side, engine_side, what: str) -> list:
        """Await both sides of one step (each bounded by its timeout). If either fails, raise one TransportError
        that tells both sides' stories and whether the engine's process still runs."""
        results = await asyncio.gather(trainer_side, engine_side, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            try:
                self.process.check()
                state = f"{self.process} is still running"
            except EngineUnreachable as e:
                state = str(e)
            raise TransportError(f"{what} failed: {'; '.join(str(e) for e in errors)}; {state}",
                                 ranks=(1,)) from errors[0]
        return results

    def check(self) -> None:
        self.process.check()

    async def monitor(self) -> NoReturn:
        last_answer = time.monotonic()
        while True:
            await asyncio.sleep(MONITOR_S)
            self.check()
            if await self.engine.health(self.cfg.engine_timeout_s):
                last_answer = time.monotonic()
            elif (silent_s := time.monotonic() - last_answer) > self.cfg.engine_timeout_s:
                raise EngineUnreachable(f"{self.process}: /health unanswered for {silent_s:.0f} s (engine_timeout_s="
                                        f"{self.cfg.engine_timeout_s:g}), though the process runs: stopped or stuck")

    async def disconnect(self) -> None:
        await self.engine.aclose()

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.process.stop()


def place(cfg: RunConfig) -> Placement:
    return Separate(cfg) if cfg.placement == "separate" else Colocated(cfg)
