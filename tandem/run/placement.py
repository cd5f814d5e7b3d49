"""Where the engine runs relative to the trainer, and how new weights reach it.

`Colocated` (the default on the CPU, `RunConfig.placement`): the engine's thread in the trainer's process, on a
CUDA stream of its own; weights handed over by reference in memory (`InProcessSender`): the engine copies the
trainer's tensors into its parameters, ordered on the device. `Disaggregated`: a prefill and a decode server behind
a router. `Separate` (the default on CUDA): the engine in a process of its own (`EngineProcess`), driven over its
HTTP API (`EngineClient`). Its weights, by `RunConfig.weight_transport`:
- "group": broadcast SGLang-style over a torch.distributed group (NCCL on CUDA, gloo on CPU): the trainer has the
  engine join with `/init_weights_update_group` once, then per update calls `/update_weights_from_distributed`
  while its `DistSender` broadcasts the buckets (pipelined, see `tandem.transport.dist`). Never a call per tensor.
- "ipc" (the default when both share one GPU, where NCCL cannot run two ranks): the trainer's tensors go to the
  engine's process by reference (`IpcSender`: CUDA IPC handles, or shared memory on a CPU) through a pipe of its
  own, and per update the trainer asks the engine's process to receive and load them
  (`EngineProcess.update_weights`).

Every sync is the same two sides run together: the trainer's `WeightSender.send`, and the engine's
`receive_and_load` (its receiver's `receive`, the load, `release`), which replies with a `SyncReply`. What excludes
generation is only the load: the engine receives the new weights while it keeps generating (into a staging copy, or
by reference: nothing to receive), then pauses (the run's pause mode), copies them into its parameters, and
resumes. `SyncStats` measures the transfer and that pause separately. On one GPU (colocated, ipc) the run does
not wait for the load at all: `send` returns once it is queued to the engine, and the trainer's next write into its
weights fences on the engine's reads (`tandem.run.pending`).
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import os
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractAsyncContextManager
from typing import NoReturn

import torch

from tandem.config import RunConfig, resolve_model
from tandem.engine.client import EngineClient, EngineUnreachable
from tandem.engine.engine import Engine, EngineError
from tandem.run.engine_process import EngineProcess
from tandem.run.heap import freeze_heap
from tandem.run.pending import PendingSync, SyncStats
from tandem.transport.dist import DistSender, rendezvous
from tandem.transport.inprocess import InProcessSender
from tandem.transport.ipc import IpcSender
from tandem.transport.switch import switching
from tandem.transport.sync import SyncReply
from tandem.transport.weights import TransferStats, TransportError, WeightSender

NamedTensors = Iterable[tuple[str, torch.Tensor]]
# the trainer's weights and their version, unchanged while the context is held (no step runs meanwhile)
CurrentWeights = Callable[[], AbstractAsyncContextManager[tuple[NamedTensors, int]]]
MONITOR_S = 1.0  # how often the monitor looks at the engine
GROUP = "tandem-weights"


class Placement(abc.ABC):
    """`engine`: what the rollout manager and the run loop drive (the `Engine`, or an `EngineClient` of one)."""

    engine: Engine | EngineClient
    num_engines = 1  # engine replicas (the run's idle fraction is per engine)

    @abc.abstractmethod
    async def start(self, named_weights: NamedTensors, version: int) -> SyncStats:
        """Connect the weight transport and push the trainer's weights as `version` (so both sides start from the
        same weights, whatever device drew them). Call once, before anything generates."""

    @abc.abstractmethod
    async def push(self, named_weights: NamedTensors, version: int) -> SyncStats:
        """Make the engine hold `named_weights` as `version`; returns once it does. Reads the tensors only before
        it returns. Raises (naming the engine) when the transfer fails; the run cannot continue after that."""

    async def send(self, named_weights: NamedTensors, version: int) -> PendingSync:
        """`push`, returning as early as the placement allows: a placement whose engine reads the trainer's tensors
        by reference (one GPU) returns once the load is queued to the engine, and the trainer must call the
        result's `fence` before it writes the tensors again (see `tandem.run.pending`); the others return once
        the engine holds the weights (a completed `PendingSync`). Raises as `push` does; a load that fails later
        raises from `fence` and `applied`."""
        return PendingSync.completed(await self.push(named_weights, version))

    pending: PendingSync | None = None  # (a placement whose `send` returns early) its last push

    async def _after_previous(self) -> None:
        """Before an early-returning `send`: the previous push's load first (normally applied long ago), fenced, so
        that pushes apply one at a time and in order; raises its error (once: it is forgotten here)."""
        previous, self.pending = self.pending, None
        if previous is None:
            return
        try:
            if not previous.done():
                await previous.applied()
        except BaseException:
            previous.abandon()
            raise
        previous.fence()

    async def _push_by_send(self, named_weights: NamedTensors, version: int) -> SyncStats:
        """`push` as `send`, then the wait for the engine's load, then the fence (this thread's stream waits for the
        engine's reads). A push that fails is abandoned: a load not yet reading reads nothing."""
        pending = await self.send(named_weights, version)
        try:
            with switching():  # this thread wakes when the engine's side set the load's result: take the GIL soon
                stats = await pending.applied()
        except BaseException:
            pending.abandon()
            if self.pending is pending:
                self.pending = None  # (its error is raised here: the next push does not raise it again)
            raise
        pending.fence()
        return SyncStats(stats.sent, stats.reply, stats.applied_s or stats.sync_s)

    @abc.abstractmethod
    def check(self) -> None:
        """Raise if the engine is gone (its thread or process ended)."""

    async def monitor(self, current_weights: CurrentWeights | None = None) -> NoReturn:
        """Never returns; raises once the engine is gone. `current_weights`: for a placement that brings an engine
        back (replicas), to give it the trainer's weights."""
        while True:
            await asyncio.sleep(MONITOR_S)
            self.check()

    def view(self) -> dict:
        """What each step's record adds about the engines (replicas: members, restarts, checksums)."""
        return {}

    async def disconnect(self) -> None:  # noqa: B027 (most placements hold nothing per event loop)
        """Release what the current event loop holds (connections)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and the transport."""


class Colocated(Placement):
    """The engine's thread in this process. On CUDA the engine runs on a stream of its own (high priority): its
    steps then never queue behind the trainer's kernels on the default stream, and the GPU interleaves the two. A
    push hands the trainer's tensors over by reference, in this thread (no worker thread, no copy but the engine's
    own into its parameters, no checksum: nobody compares one engine's); the engine's copy waits for the trainer's
    writes, and the trainer's next writes for the copy, on the device. `send` returns once the load is in the
    engine's queue (`tandem.run.pending`); `push` once the engine applied it."""

    def __init__(self, cfg: RunConfig):
        device = torch.device(cfg.engine.device)
        stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self.engine = Engine(cfg.model, cfg.engine, dtype=cfg.engine_dtype, seed=cfg.seed)
        self.pause_mode, self.timeout_s = cfg.rollout.pause_mode, cfg.weight_sync_timeout_s

    async def start(self, named_weights: NamedTensors, version: int) -> SyncStats:
        stats = await self.push(named_weights, version)
        freeze_heap()
        return stats

    async def push(self, named_weights: NamedTensors, version: int) -> SyncStats:
        return await self._push_by_send(named_weights, version)

    async def send(self, named_weights: NamedTensors, version: int) -> PendingSync:
        """Returns once the load of the trainer's tensors (by reference) is in the engine's queue, ahead of every
        later request; the previous push's load first (its error raised). ValueError on bad input, before the
        engine hears of it."""
        await self._after_previous()
        t0 = time.perf_counter()
        handover = InProcessSender.offer(named_weights)  # ValueError: refused before the engine hears of it
        num_bytes = sum(t.nbytes for t in handover.tensors.values())
        try:
            loaded = self.engine.load_soon(handover, version, self.pause_mode)
        except BaseException:
            handover.release()
            raise
        reply: concurrent.futures.Future = concurrent.futures.Future()

        def answer(future: concurrent.futures.Future) -> None:  # (on the engine's thread)
            if (error := future.exception()) is not None:
                reply.set_exception(error)
            else:
                applied, pause_s = future.result()
                reply.set_result(SyncReply(applied, pause_s, pause_s, 0.0, num_bytes, 1, len(handover)))

        def close(ordered: bool) -> None:
            handover.release()  # no read starts after this (one reading finishes enqueuing first)
            if ordered:
                handover.wait_read()  # the caller's current stream waits for the engine's copy

        loaded.add_done_callback(answer)
        t1 = time.perf_counter()
        sent = TransferStats(version, num_bytes, 1, len(handover), t1 - t0, phases={"offer": t1 - t0})
        self.pending = PendingSync(version, sent, reply, close, self.timeout_s, "the engine's thread")
        return self.pending

    def check(self) -> None:
        if not self.engine.is_alive():
            raise EngineError("engine thread stopped")

    def shutdown(self) -> None:
        if self.pending is not None:
            self.pending.abandon()  # a load still queued reads nothing (the engine refuses it as it stops)
        self.engine.shutdown()
        gc.unfreeze()  # (what `start` froze may go again)


class Separate(Placement):
    """The engine's process listens on 127.0.0.1; the trainer hosts the weight group's store on a free local port.
    The monitor also fails when the engine leaves `/health` unanswered for `engine_timeout_s` (stopped or stuck)."""

    def __init__(self, cfg: RunConfig):
        resolve_model(cfg.model)  # a bad model name is a ValueError here, not a failed child
        self.cfg = cfg
        self.device = cfg.trainer_device or cfg.engine.device
        self.backend = "nccl" if self.device.startswith("cuda") else "gloo"
        self.sender: WeightSender | None = None
        self.ipc = cfg.resolved_weight_transport == "ipc"
        self._loads = concurrent.futures.ThreadPoolExecutor(1, "tandem-ipc-load") if self.ipc else None
        self.process = EngineProcess(cfg.model, cfg.engine, cfg.seed, cfg.engine_start_timeout_s, cfg.engine_dtype,
                                     ipc_timeout_s=cfg.weight_sync_timeout_s if self.ipc else None)
        try:
            self.engine = EngineClient(self.process.url, cfg.engine_timeout_s).connect()
        except BaseException:
            self.process.stop()
            raise

    async def start(self, named_weights: NamedTensors, version: int) -> SyncStats:
        timeout_s = self.cfg.weight_sync_timeout_s
        if self.ipc:
            self.sender = IpcSender(self.process.weights_conn, timeout_s, str(self.process))
            freeze_heap()  # (this process's: its event loop runs the agents)
            return await self.push(named_weights, version)
        store = rendezvous("127.0.0.1", timeout_s)
        joined = self.engine.init_weights_update_group("127.0.0.1", store.port, 1, 2, GROUP, self.backend, timeout_s)
        sender = asyncio.to_thread(DistSender, store, 2, 0, self.backend, timeout_s,
                                   self.cfg.weight_bucket_bytes, f"trainer pid {os.getpid()}",
                                   self.device if self.backend == "nccl" else None)
        self.sender, _ = await self._both(sender, joined, "joining the weight group")
        freeze_heap()
        return await self.push(named_weights, version)

    async def push(self, named_weights: NamedTensors, version: int) -> SyncStats:
        if self.ipc:
            return await self._push_by_send(named_weights, version)
        t0 = time.perf_counter()
        sent = asyncio.to_thread(self.sender.send, named_weights, version)
        sent, reply = await self._both(sent, self._receive_and_load(version), f"weight sync of version {version}")
        return SyncStats(sent, reply, time.perf_counter() - t0)

    async def send(self, named_weights: NamedTensors, version: int) -> PendingSync:
        """ipc: returns once the transfer is posted and the engine's process asked to load it (the engine applies
        it at its next step boundary; `tandem.run.pending`); the previous push's load first (its error raised).
        ValueError on bad input, once the engine's process heard of the abort. A group: as `push`."""
        if not self.ipc:
            return await super().send(named_weights, version)
        await self._after_previous()
        timeout_s, sender = self.cfg.weight_sync_timeout_s, self.sender
        t0 = time.perf_counter()
        reply = self._loads.submit(self._load, version)  # first: its receive takes an aborted transfer too
        try:
            posted = sender.post(named_weights, version)
        except BaseException as posting:
            with contextlib.suppress(BaseException):  # (the engine's process refuses the aborted transfer)
                await asyncio.wrap_future(reply)
            if not reply.cancelled() and isinstance(reply.exception(), EngineUnreachable):  # it died: its end says more
                raise reply.exception() from posting
            raise

        def close(ordered: bool) -> None:
            failed = reply.exception() if reply.done() else None
            if not ordered or not reply.done() or (failed is not None and not isinstance(failed, ValueError)):
                sender.abandon(f"the transfer of weights version {version} was abandoned unacknowledged")
            else:  # (the engine's process held and released it, whether it loaded it or refused it)
                sender.settle(posted)  # this thread's stream waits for the engine's reads

        sent = TransferStats(version, posted.num_bytes, 1, posted.num_tensors, time.perf_counter() - t0,
                             phases={"post": posted.t1 - posted.t0})
        # (the load's own wait is bounded by timeout_s and names the engine's process: this bound is a backstop)
        self.pending = PendingSync(version, sent, reply, close, 2 * timeout_s, str(self.process))
        return self.pending

    def _load(self, version: int) -> SyncReply:
        """(ipc, in a worker thread) The engine's process receives the posted transfer and loads it."""
        reply = self.process.update_weights(version, self.cfg.rollout.pause_mode, self.cfg.weight_sync_timeout_s)
        self.engine.weight_version = reply.weight_version  # (as the group route's reply sets it)
        return reply

    async def _receive_and_load(self, version: int) -> SyncReply:
        """(A group) Have the engine receive the transfer over HTTP and load it."""
        return await self.engine.update_weights_from_distributed(GROUP, version, self.cfg.rollout.pause_mode)

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

    async def monitor(self, current_weights: CurrentWeights | None = None) -> NoReturn:
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
        if self.pending is not None:
            self.pending.abandon()
        if self.sender is not None:
            self.sender.close()
        self.process.stop()
        if self._loads is not None:
            self._loads.shutdown(wait=False)
        gc.unfreeze()


class Disaggregated(Placement):
    """A prefill server and a decode server, each in a process of its own (`EngineProcess`, `EngineConfig.role`),
    behind a router in this process (`tandem.server.router`), which the rollout manager drives as it would one
    engine. Each server takes the trainer's weights by reference through its own pipe (ipc). An update pauses both
    servers (through the router) before either loads, and continues them only once both hold the new version."""

    num_engines = 2  # (the router's idle time is both servers': the run's idle fraction is their mean)

    def __init__(self, cfg: RunConfig):
        from tandem.server.http import ServerThread
        from tandem.server.router import RouterConfig, build_router_app

        resolve_model(cfg.model)
        self.cfg, self.processes, self.senders, self.router = cfg, [], [], None
        try:
            for role in ("prefill", "decode"):
                config = dataclasses.replace(cfg.engine, role=role)
                self.processes.append(EngineProcess(cfg.model, config, cfg.seed, cfg.engine_start_timeout_s,
                                                    cfg.engine_dtype, ipc_timeout_s=cfg.weight_sync_timeout_s))
            config = RouterConfig(prefill=(self.processes[0].url,), decode=(self.processes[1].url,),
                                  control_timeout_s=cfg.engine_timeout_s)
            self.router = ServerThread(app=build_router_app(config)).start()
            self.engine = EngineClient(self.router.url, cfg.engine_timeout_s).connect()
        except BaseException:
            self.shutdown()
            raise

    async def start(self, named_weights: NamedTensors, version: int) -> SyncStats:
        self.senders = [IpcSender(p.weights_conn, self.cfg.weight_sync_timeout_s, str(p)) for p in self.processes]
        return await self.push(named_weights, version)

    async def push(self, named_weights: NamedTensors, version: int) -> SyncStats:
        t0, mode, timeout_s = time.perf_counter(), self.cfg.rollout.pause_mode, self.cfg.weight_sync_timeout_s
        named = list(named_weights)  # (read once per server)
        await self.engine.pause(mode)  # both servers, before either loads
        try:
            sides = [side for sender, process in zip(self.senders, self.processes, strict=True)
                     for side in (asyncio.to_thread(sender.send, named, version),
                                  asyncio.to_thread(process.update_weights, version, mode, timeout_s))]
            results = await asyncio.gather(*sides, return_exceptions=True)
            if errors := [r for r in results if isinstance(r, BaseException)]:
                raise TransportError(f"weight sync of version {version} failed: "
                                     f"{'; '.join(str(e) for e in errors)}", ranks=(1,)) from errors[0]
        finally:
            await self.engine.resume()  # both, once both hold the version (or the sync failed: the run ends)
        self.engine.weight_version = version
        # the decode server's side stands for the sync (the prefill server's ran at the same time)
        return SyncStats(results[2], results[3], time.perf_counter() - t0)

    def check(self) -> None:
        for process in self.processes:
            process.check()

    async def disconnect(self) -> None:
        await self.engine.aclose()

    def shutdown(self) -> None:
        for sender in self.senders:
            sender.close()
        if self.router is not None:
            self.router.stop()
        for process in self.processes:
            process.stop()


def place(cfg: RunConfig) -> Placement:
    if cfg.placement == "ray":
        from tandem.run.ray_placement import ray_replicas

        return ray_replicas(cfg)
    if cfg.replicas:
        from tandem.run.replicas import Replicas

        return Replicas(cfg)
    return {"separate": Separate, "disaggregated": Disaggregated}.get(cfg.placement, Colocated)(cfg)
