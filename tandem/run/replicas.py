"""Engine replicas (`rollout.num_engines`): N engine servers behind one router, all updated by one weight broadcast.

    start N replicas (processes here; Ray actors under `tandem.run.ray_placement`), a router in front of them
    (`tandem.server.router`: every turn of an episode on one replica, a new episode on the least loaded)
    one weight group: the trainer rank 0, replica i rank i + 1 in slot order (stable across restarts)
    per update: one broadcast per bucket to every replica while they generate; once every replica holds it, all
        pause (the transfer's commit), all load, all resume; their versions and weight checksums must agree
    a replica that dies (or fails a collective, or leaves /health unanswered) leaves the router and the group (which
        is rebuilt before the next broadcast); its episodes' groups run again on the others (the rollout manager)
    with `rollout.restart_engines`, a new replica takes its slot, joins a rebuilt group, receives the current
        weights, and only then joins the router (which checks that it holds the others' version)

Every wait is bounded: the group's collectives by `weight_sync_timeout_s` (naming the rank and replica that did
not answer), the HTTP calls by `engine_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import NoReturn, Protocol

import torch

from tandem.config import RunConfig, resolve_model
from tandem.engine.client import EngineClient, EngineClientError, EngineUnreachable
from tandem.run.engine_process import EngineProcess
from tandem.run.placement import MONITOR_S, CurrentWeights, NamedTensors, Placement, SyncStats
from tandem.transport.dist import DistSender, rendezvous
from tandem.transport.weights import TransportError

log = logging.getLogger(__name__)

GROUP = "tandem-replicas"
HEALTH_S = 5.0  # a /health answer slower than this counts as none


class ReplicaHandle(Protocol):
    """One replica's server, wherever it runs: `url`, `check()` (raises EngineUnreachable once it is gone),
    `stop(grace_s)`, `kill()`."""

    url: str

    def check(self) -> None: ...

    def stop(self, grace_s: float = 30.0) -> None: ...

    def kill(self) -> None: ...


Launcher = Callable[[int], ReplicaHandle]  # starts the replica of slot i (blocking until it serves)


@dataclasses.dataclass(eq=False)
class Replica:
    slot: int  # its place in the rank order (weight-group rank: its position among the members, plus one)
    handle: ReplicaHandle
    client: EngineClient

    def __str__(self) -> str:
        return f"replica {self.slot} ({self.handle})"


def process_launcher(cfg: RunConfig) -> Launcher:
    """Replicas as processes of this host (`EngineProcess`); on CUDA replica i on GPU index(engine.device) + i."""

    def launch(slot: int) -> EngineProcess:
        config = cfg.engine
        if config.device.startswith("cuda"):
            config = dataclasses.replace(config, device=f"cuda:{(torch.device(config.device).index or 0) + slot}")
        return EngineProcess(cfg.model, config, cfg.seed, cfg.engine_start_timeout_s, cfg.engine_dtype)

    return launch


class Replicas(Placement):
    """`engine`: the router's client (what the rollout manager drives). `launcher`: how a replica starts (default:
    a process). `num_engines`, `restarts` (replicas started after the first N), `lost` (why each one left)."""

    def __init__(self, cfg: RunConfig, launcher: Launcher | None = None, label: str | None = None):
        from tandem.server.http import ServerThread
        from tandem.server.router import RouterConfig, build_router_app

        resolve_model(cfg.model)
        self.cfg, self.launcher = cfg, launcher or process_launcher(cfg)
        self.num_engines, self.restarts, self.lost = cfg.rollout.num_engines, 0, []
        self.device = cfg.trainer_device or cfg.engine.device
        self.backend = "nccl" if self.device.startswith("cuda") else "gloo"
        self.label = label or f"trainer pid {os.getpid()}"
        self.host = "127.0.0.1"  # where the replicas reach the trainer's store (Ray: the trainer's node address)
        self.members: list[Replica] = []
        self.sender: DistSender | None = None
        self.group_name, self._generation, self._group_stale = GROUP, 0, True
        self.version = 0  # the version every member holds
        self.checksums: dict[int, str] = {}  # slot -> weight checksum after the last update
        self.first_versions: dict[str, int] = {}  # a restarted replica's URL -> the version it joined the router with
        self._restarting: dict[int, asyncio.Future] = {}
        self._lock: asyncio.Lock | None = None
        self.router = None
        try:
            handles = _start_all(self.launcher, range(self.num_engines))
            self.members = [Replica(i, h, EngineClient(h.url, cfg.engine_timeout_s).connect())
                            for i, h in enumerate(handles)]
            config = RouterConfig(servers=tuple(m.handle.url for m in self.members),
                                  control_timeout_s=cfg.engine_timeout_s)
            self.router = ServerThread(app=build_router_app(config)).start()
            self.engine = EngineClient(self.router.url, cfg.engine_timeout_s).connect()
        except BaseException:
            self.shutdown()
            raise

    # ---- the weight group ------------------------------------------------------------------------------------
    async def start(self, named_weights: NamedTensors, version: int) -> SyncStats:
        return await self.push(named_weights, version)

    async def push(self, named_weights: NamedTensors, version: int) -> SyncStats:
        """One broadcast to every member; a member that fails it is retired and the others get it again over a
        rebuilt group. Raises once no member is left (or a failure names none)."""
        named = list(named_weights)  # (read once per attempt: references, no copies)
        async with self._locked():
            return await self._push(named, version)

    async def _push(self, named: list, version: int) -> SyncStats:
        while True:
            if not self.members:
                raise EngineUnreachable(f"no engine replica left to update to version {version}: "
                                        + "; ".join(self.lost))
            before = list(self.members)
            try:
                if self._group_stale:
                    await self._form_group()
                return await self._push_once(named, version)
            except (TransportError, EngineClientError) as e:
                failed = await self._failed_members(e)
                if not failed and self.members == before:  # (a member the monitor retired meanwhile explains it)
                    raise
                for member in failed:
                    await self._retire(member, f"failed the update to version {version}: {e}")

    async def _push_once(self, named: list, version: int) -> SyncStats:
        t0, mode, loop = time.perf_counter(), self.cfg.rollout.pause_mode, asyncio.get_running_loop()
        members = list(self.members)

        paused_at = []

        def commit() -> None:  # every member holds the transfer: all pause before any loads
            paused_at.append(time.perf_counter())
            pauses = asyncio.run_coroutine_threadsafe(self._each(members, lambda c: c.pause(mode)), loop)
            pauses.result(self.cfg.engine_timeout_s)

        sent = asyncio.ensure_future(asyncio.to_thread(self.sender.send, named, version, commit))
        loads = [asyncio.ensure_future(m.client.update_weights_from_distributed(self.group_name, version, mode))
                 for m in members]
        answered = members
        try:
            await asyncio.wait([sent])  # (bounded by the transport's timeouts)
            # then the members' replies: a member that has not answered within the group's timeout is silent
            _, silent = await asyncio.wait(loads, timeout=self.cfg.weight_sync_timeout_s)
            for load in silent:
                load.cancel()
            answered = [m for m, load in zip(members, loads, strict=True) if load not in silent]
        finally:
            resumed = await asyncio.gather(*(m.client.resume() for m in answered), return_exceptions=True)
            resumed_at = time.perf_counter()
        results = [sent.exception() or sent.result()] + [
            EngineUnreachable(f"{m}: did not answer the update within weight_sync_timeout_s="
                              f"{self.cfg.weight_sync_timeout_s:g}") if load.cancelled()
            else load.exception() or load.result() for m, load in zip(members, loads, strict=True)]
        errors = [(who, r) for who, r in zip(["the trainer's send", *members], results, strict=True)
                  if isinstance(r, BaseException)]
        errors += [(m, r) for m, r in zip(answered, resumed, strict=True) if isinstance(r, BaseException)]
        if errors:
            self._group_stale = True
            raise TransportError(f"weight sync of version {version} failed: "
                                 + "; ".join(f"{who}: {r}" for who, r in errors),
                                 ranks=_blamed(results[0], results[1:])) from errors[0][1]
        replies = results[1:]
        checksums = {m.slot: r.weights_checksum for m, r in zip(members, replies, strict=True)}
        if len({r.weight_version for r in replies}) != 1 or len(set(checksums.values())) != 1:
            raise RuntimeError(f"replicas disagree after the update to version {version}: " + ", ".join(
                f"{m}: version {r.weight_version} checksum {r.weights_checksum}"
                for m, r in zip(members, replies, strict=True)))
        self.version, self.checksums = version, checksums
        self.engine.weight_version = version
        # generation was excluded from the first pause to the last resume (the replies' pause_s: their loads only)
        reply = dataclasses.replace(replies[0], pause_s=resumed_at - paused_at[0])
        return SyncStats(results[0], reply, time.perf_counter() - t0)

    async def _form_group(self) -> None:
        """A new weight group of the trainer and every member (in slot order); the old one is left first."""
        await self._leave_group()
        self._generation += 1
        self.group_name = f"{GROUP}-{self._generation}"
        timeout_s, world = self.cfg.weight_sync_timeout_s, len(self.members) + 1
        store = rendezvous(self.host, timeout_s)
        port = store.port
        sender = asyncio.to_thread(DistSender, store, world, 0, self.backend, timeout_s,
                                   self.cfg.weight_bucket_bytes, self.label,
                                   self.device if self.backend == "nccl" else None)
        joins = [m.client.init_weights_update_group(self.host, port, rank, world, self.group_name, self.backend,
                                                    timeout_s) for rank, m in enumerate(self.members, 1)]
        results = await asyncio.gather(sender, *joins, return_exceptions=True)
        if isinstance(results[0], DistSender):
            self.sender = results[0]
        if errors := [r for r in results if isinstance(r, BaseException)]:
            raise TransportError(f"forming the weight group of {world - 1} replicas failed: "
                                 + "; ".join(map(str, errors)), ranks=_blamed(results[0], results[1:])) from errors[0]
        self._group_stale = False

    async def _leave_group(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
            await asyncio.gather(*(m.client.destroy_weights_update_group(self.group_name) for m in self.members),
                                 return_exceptions=True)  # (a member that never joined it has nothing to leave)

    async def _failed_members(self, error: Exception) -> list[Replica]:
        """The members to blame for `error`: those whose server is gone or leaves /health unanswered, else those the
        transport named (a strict subset: if it names every member, the fault is not theirs)."""
        gone = []
        for m in self.members:
            try:
                m.handle.check()
                if not await m.client.health(min(self.cfg.engine_timeout_s, HEALTH_S)):
                    gone.append(m)
            except EngineUnreachable:
                gone.append(m)
        if gone:
            return gone
        ranks = set(getattr(error, "ranks", ()) or ())
        named = [m for rank, m in enumerate(self.members, 1) if rank in ranks]
        return named if 0 < len(named) < len(self.members) else []

    # ---- losing and restarting replicas ------------------------------------------------------------------------
    async def _retire(self, member: Replica, reason: str) -> None:
        """Out of the router and the group (rebuilt before the next broadcast), its server stopped."""
        if member not in self.members:
            return
        log.warning("%s leaves the rotation: %s", member, reason)
        self.members.remove(member)
        self.lost.append(f"{member}: {reason}")
        self._group_stale = True
        with contextlib.suppress(EngineClientError, ValueError):
            await self.engine.remove_worker(member.handle.url)
        with contextlib.suppress(EngineClientError):
            await member.client.aclose()
        await asyncio.to_thread(member.handle.kill)

    async def monitor(self, current_weights: CurrentWeights | None = None) -> NoReturn:
        """Watch every member (its server alive, its /health answered); retire the ones gone; with
        `restart_engines` start a new replica in each free slot and admit it once it holds the current weights.
        Raises once no member is left and none is restarting."""
        last_answer: dict[Replica, float] = {}
        while True:
            await asyncio.sleep(MONITOR_S)
            for m in list(self.members):
                try:
                    m.handle.check()
                except EngineUnreachable as e:
                    await self._retire(m, str(e))
                    continue
                now = time.monotonic()
                if await m.client.health(min(self.cfg.engine_timeout_s, HEALTH_S)):
                    last_answer[m] = now
                elif now - last_answer.setdefault(m, now) > self.cfg.engine_timeout_s:
                    await self._retire(m, f"/health unanswered for {now - last_answer[m]:.0f} s (stopped or stuck)")
            if self.cfg.rollout.restart_engines:
                await self._restart_free_slots(current_weights)
            elif not self.members:
                raise EngineUnreachable("every engine replica is gone: " + "; ".join(self.lost))

    async def _restart_free_slots(self, current_weights: CurrentWeights | None) -> None:
        taken = {m.slot for m in self.members} | set(self._restarting)
        for slot in sorted(set(range(self.num_engines)) - taken):
            log.warning("restarting replica %d", slot)
            self._restarting[slot] = asyncio.ensure_future(asyncio.to_thread(self.launcher, slot))
        for slot, starting in list(self._restarting.items()):
            if not starting.done():
                continue
            del self._restarting[slot]
            try:
                handle = starting.result()
                member = Replica(slot, handle, EngineClient(handle.url, self.cfg.engine_timeout_s).connect())
            except Exception as e:  # counted; the slot is tried again at the next look
                self.lost.append(f"replica {slot}: the restart failed: {e}")
                continue
            self.restarts += 1
            await self._admit(member, current_weights)

    async def _admit(self, member: Replica, current_weights: CurrentWeights | None) -> None:
        """Into the group (rebuilt with it), the current weights to every member, then into the router, which
        checks that it holds the version the others hold."""
        async with contextlib.AsyncExitStack() as stack:
            named, version = await stack.enter_async_context(current_weights()) if current_weights else ([], None)
            await stack.enter_async_context(self._locked())
            self.members = sorted([*self.members, member], key=lambda m: m.slot)
            self._group_stale = True
            if version is not None:
                await self._push(list(named), version)
            if member not in self.members:  # it failed the update: retired, and its slot free again
                return
            await self.engine.add_worker(member.handle.url, self.version)
            self.first_versions[member.handle.url] = self.version
            log.warning("%s rejoined at weight version %d", member, self.version)

    @contextlib.asynccontextmanager
    async def _locked(self):
        """One weight operation at a time (an update, a rejoin)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            yield

    # ---- the rest of a placement ---------------------------------------------------------------------------
    @staticmethod
    async def _each(members: list[Replica], call) -> None:
        results = await asyncio.gather(*(call(m.client) for m in members), return_exceptions=True)
        if errors := [f"{m}: {r}" for m, r in zip(members, results, strict=True) if isinstance(r, BaseException)]:
            raise EngineUnreachable("; ".join(errors))

    def check(self) -> None:
        if not self.members and not self._restarting:
            raise EngineUnreachable("every engine replica is gone: " + "; ".join(self.lost))

    def view(self) -> dict:
        """What a run records: the members' slots, restarts, losses, checksums."""
        return {"replicas": [m.slot for m in self.members], "replica_restarts": self.restarts,
                "replicas_lost": len(self.lost), "replica_checksums": dict(self.checksums)}

    async def disconnect(self) -> None:
        for client in [self.engine, *(m.client for m in self.members)]:
            if client is not None:
                await client.aclose()
        for starting in self._restarting.values():
            starting.cancel()

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.router is not None:
            self.router.stop()
        for m in self.members:
            m.handle.stop()
        for starting in self._restarting.values():  # a restart still starting: stopped once it has started
            with contextlib.suppress(BaseException):
                starting.result().stop() if starting.done() else None


def _blamed(trainer_side, member_sides: list) -> tuple[int, ...]:
    """The group ranks a failed step names: those the trainer's transport named, else the members whose side
    failed (rank = position + 1)."""
    if isinstance(trainer_side, TransportError) and trainer_side.ranks:
        return tuple(r for r in trainer_side.ranks if r > 0)
    return tuple(rank for rank, r in enumerate(member_sides, 1) if isinstance(r, BaseException))


def _start_all(launcher: Launcher, slots) -> list[ReplicaHandle]:
    """Start the replicas of `slots` at once (each blocks until it serves); if any fails, stop the others."""
    from concurrent.futures import ThreadPoolExecutor

    slots = list(slots)
    with ThreadPoolExecutor(len(slots)) as pool:
        futures = [pool.submit(launcher, slot) for slot in slots]
        results = []
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as e:
                results.append(e)
    if errors := [r for r in results if isinstance(r, BaseException)]:
        for r in results:
            if not isinstance(r, BaseException):
                r.stop(grace_s=0)
        raise errors[0]
    return results
