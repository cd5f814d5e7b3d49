"""The engine's async facade: a token-in token-out generation API over an engine core that runs in its own thread.

Every call from the caller's side only validates and enqueues a typed command (`tandem.engine.commands`); the core
(`tandem.engine.core`) is touched by the engine thread alone, so the caller's event loop never blocks on the
engine and commands (pause, weight updates, aborts) are ordered with steps. Many concurrent `generate` calls batch
together. Under tensor parallelism the thread runs on rank 0 and publishes each command to the other ranks before
applying it (their loop is `tandem.run.tp.run_follower`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future

import torch

from tandem.config import EngineConfig, ModelConfig, PauseMode
from tandem.distributed.parallel import SINGLE, TPGroup
from tandem.distributed.watchdog import Watchdog
from tandem.engine import commands
from tandem.engine.core import EngineCore, EngineError
from tandem.engine.request import validate_request
from tandem.model.qwen3 import Qwen3ForCausalLM
from tandem.tokenizer import load_tokenizer
from tandem.transport.weights import NamedWeights, as_mapping
from tandem.types import EngineStats, GenerateOutput, SamplingParams, TokenDelta

__all__ = ["Engine", "EngineError", "make_watchdog"]

log = logging.getLogger(__name__)
STALL_WAIT_S = 0.001  # a stalled engine's wait for a command before it steps again (`EngineCore.stalled`)


def make_watchdog(core: EngineCore) -> Watchdog:
    """The watchdog of the loop that drives `core` (it dumps the flight recorder and stacks when the loop stalls)."""
    timeout = core.config.watchdog_timeout_s
    watchdog = Watchdog(core.recorder, timeout or 1.0, action=core.config.watchdog_action, enabled=timeout > 0)
    watchdog.add_state("engine", lambda: {"running": len(core.scheduler.running), "paused": core.paused,
                                          "queued": len(core.scheduler.waiting), "step": core.stats.num_steps})
    if core.lockstep is not None:
        watchdog.add_state("lockstep", lambda: core.lockstep.last_digest)
    return watchdog


class Engine:
    """`tp`: this rank's tensor-parallel group; the facade serves rank 0 (followers drive a bare `EngineCore`).
    `tokenizer`: the one saved in directory `model` (`tandem.tokenizer.load_tokenizer`), else None (token ids
    only); the engine itself never uses it, its callers' text fields do."""

    def __init__(self, model: str | ModelConfig | Qwen3ForCausalLM = "tiny", config: EngineConfig | None = None,
                 dtype: str | None = None, seed: int = 0, tp: TPGroup = SINGLE):
        assert tp.rank == 0, "ranks > 0 run tandem.run.tp.run_follower over an EngineCore"
        self.core = EngineCore(model, config, dtype=dtype, seed=seed, tp=tp)
        self.tokenizer = load_tokenizer(model, self.model_config.vocab_size) if isinstance(model, str) else None
        self.watchdog = make_watchdog(self.core)
        self._inbox: queue.SimpleQueue[tuple[commands.Command, Future | None]] = queue.SimpleQueue()
        self._futures: dict[str, Future] = {}  # of the requests in the engine (touched by the engine thread)
        self._watches: dict[str, list] = {}  # rid -> [callback, output tokens sent] (see `watch`)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self.watchdog.start()  # once built: loading a model is no stall
        self._thread.start()

    # what callers read of the engine (the core's; read-only from outside the engine thread)
    config = property(lambda self: self.core.config)
    model = property(lambda self: self.core.model)
    model_config = property(lambda self: self.core.model_config)
    max_context_len = property(lambda self: self.core.max_context_len)
    weight_version = property(lambda self: self.core.weight_version)
    paused = property(lambda self: self.core.paused)
    tp = property(lambda self: self.core.tp)
    pool = property(lambda self: self.core.pool)
    tier = property(lambda self: self.core.tier)
    cache = property(lambda self: self.core.cache)
    runner = property(lambda self: self.core.runner)
    recorder = property(lambda self: self.core.recorder)

    # ---- caller side: validation, then a command for the engine thread -----------------------------------
    async def generate(self, input_ids: list[int], sampling: SamplingParams | None = None,
                       rid: str | None = None, export_kv_from: int | None = None,
                       prompt_len: int | None = None, return_routed_experts: bool = False,
                       export_pinned: bool = False) -> GenerateOutput:
        """Generate from `input_ids`. Raises ValueError for a malformed request (nothing is enqueued). If the
        awaiting task is cancelled (a client went away) the request is aborted and its pages freed.
        `export_kv_from`, `prompt_len`, `return_routed_experts`, `export_pinned`: see `commands.AddRequest` (a
        prefill server's request, a continuation, routing replay, a prefill server's export by reference)."""
        sampling = sampling or SamplingParams()
        rid = rid if rid is not None else uuid.uuid4().hex
        self._check_alive()
        self.validate(input_ids, sampling, rid)
        return await self._submit(commands.AddRequest(rid, list(input_ids), sampling, export_kv_from, prompt_len,
                                                      return_routed_experts, export_pinned))

    async def generate_imported(self, input_ids: list[int], sampling: SamplingParams,
                                generated: tuple[list[int], list[float], list[int]], kv,
                                rid: str | None = None, return_routed_experts: bool = False,
                                validated: bool = False) -> GenerateOutput:
        """A decode server's request: prompt `input_ids` and the tokens generated so far (`generated`: ids,
        logprobs, weight versions; the last one sampled by a prefill server with `sampling.seed`), with the KV `kv`
        that prefill server sent (`commands.ImportRequest`). The output holds every generated token. `validated`:
        the caller passed `input_ids`, `sampling` and `rid` through `validate` already (not checked again)."""
        rid = rid if rid is not None else uuid.uuid4().hex
        self._check_alive()
        if not validated:
            self.validate(input_ids, sampling, rid)
        return await self._submit(commands.ImportRequest(rid, list(input_ids), sampling, *map(list, generated), kv,
                                                         return_routed_experts))

    async def probe(self, input_ids: list[int], rid: str | None = None, reserve: bool = False) -> int:
        """How many leading tokens of `input_ids` this engine holds on its device in whole pages; with `rid`, it
        expects that request's import, with `reserve` in pages set aside for it (see `commands.Probe`)."""
        return await self._call(commands.Probe(list(input_ids), rid, reserve))

    def arm_reserved(self, rid: str, kv, version: int, bell) -> bool:
        """Queue an import's pass by reference behind a doorbell the prefill engine rings once its KV is complete,
        from the calling thread: `EngineCore.arm_reserved` (thread-safe; does not wait for the device)."""
        self._check_alive()
        return self.core.arm_reserved(rid, kv, version, bell)

    def write_reserved(self, rid: str, kv, version: int) -> bool:
        """Write an import's KV by reference into the pages its probe set aside, from the calling thread (the caller
        then compares its checksums, `MappedKV.check`): `EngineCore.write_reserved` (thread-safe; blocks for the
        device pass)."""
        self._check_alive()
        return self.core.write_reserved(rid, kv, version)

    async def _submit(self, command: commands.AddRequest | commands.ImportRequest) -> GenerateOutput:
        fut: Future = Future()
        self._inbox.put((command, fut))
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(command.rid)
            raise

    def validate(self, input_ids, sampling: SamplingParams, rid: str) -> None:
        """Raise ValueError naming what is wrong with a request; submits nothing."""
        validate_request(input_ids, sampling, rid, self.model_config.vocab_size, self.max_context_len,
                         self.pool.num_pages * self.pool.page_size)

    def watch(self, rid: str, callback: Callable[[TokenDelta], None]) -> None:
        """Have `callback` receive request `rid`'s output tokens as steps sample them, in order (`TokenDelta`s; the
        tokens of the step that ends the request come only with its output). It runs on the engine's thread: it
        must be quick and thread-safe (`loop.call_soon_threadsafe`), and what it raises is logged and ignored.
        Call before submitting the request, and `unwatch` once its output has arrived."""
        self._watches[rid] = [callback, 0]

    def unwatch(self, rid: str) -> None:
        self._watches.pop(rid, None)

    def abort(self, rid: str) -> None:
        """Abort a request if it is still running or queued (it returns with finish reason abort)."""
        self._inbox.put((commands.Abort(rid), None))

    def abort_all(self) -> None:
        """Abort every running and queued request."""
        self._inbox.put((commands.AbortAll(), None))

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating. `abort`: in-flight and queued requests return at once (finish reason abort)
        with what they generated so far. `retract`: running requests drop their KV and go back to the
        queue, to be recomputed after `resume`. `in_place`: running requests freeze, keeping their KV.
        Requests arriving while paused queue until `resume`."""
        await self._call(commands.Pause(mode))

    async def resume(self) -> None:
        await self._call(commands.Resume())

    async def update_weights(self, named_tensors: NamedWeights, version: int | None = None) -> int:
        """Load full (unsharded) tensors by Hugging Face name while paused; returns the new weight version
        (`version`, or the current one plus 1). All tensors are checked before any is loaded. Empties
        the prefix cache (see `tandem.engine.core`). An iterable is read here, a mapping (a transport's
        `FlatTensors`) by the engine's thread."""
        version, _ = await self._call(commands.LoadWeights(as_mapping(named_tensors), version))
        return version

    async def load_paused(self, named_tensors: NamedWeights, version: int | None, pause_mode: PauseMode) -> float:
        """`update_weights` inside a pause in `pause_mode` (one already paused loads and stays paused), as one command.
        In place it does not wait for the step in flight: the copies queue behind it (its tokens keep the old
        version), so the tensors must not change until the device ran them. Returns the seconds paused."""
        _, seconds = await self._call(commands.LoadWeights(as_mapping(named_tensors), version, pause_mode))
        return seconds

    def load_soon(self, named_tensors: NamedWeights, version: int | None, pause_mode: PauseMode) -> Future:
        """`load_paused` without awaiting it: the command is enqueued before this returns (ahead of every command
        and request enqueued later, so their tokens see the new weights) and runs at the engine's next step
        boundary. Returns its future, from any thread: (the new weight version, the seconds paused) once applied,
        or the load's error. Raises EngineError when the engine stopped."""
        self._check_alive()
        fut: Future = Future()
        self._inbox.put((commands.LoadWeights(as_mapping(named_tensors), version, pause_mode), fut))
        return fut

    async def flush_cache(self) -> None:
        """Empty the prefix cache. Refused (EngineError) while requests hold KV pages."""
        await self._call(commands.FlushCache())

    async def get_stats(self) -> EngineStats:
        return await self._call(commands.Snapshot())

    def shutdown(self) -> None:
        self._stop = True
        self._inbox.put((commands.Idle(), None))  # wakes the loop
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.watchdog.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def _check_alive(self) -> None:
        if self._stop or self.core.fatal is not None or not self._thread.is_alive():
            raise EngineError(f"engine stopped{f': {self.core.fatal}' if self.core.fatal else ''}")

    async def _call(self, command: commands.Command):
        self._check_alive()
        fut: Future = Future()
        self._inbox.put((command, fut))
        return await asyncio.wrap_future(fut)

    # ---- engine thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        core = self.core
        if core.pool.k_cache.is_cuda:  # events, streams and graphs of this thread belong to the engine's GPU
            torch.cuda.set_device(core.pool.k_cache.device)
            torch.cuda.set_stream(core.order.stream("compute"))  # the stream current where the core was built
        while not self._stop and core.fatal is None:
            self.watchdog.bump()
            try:  # idle: sleep until a command arrives; busy: take one if there is one, else step (stalled: after
                # waiting a little for one, as pages held elsewhere come free without a command)
                command, fut = (self._inbox.get(timeout=STALL_WAIT_S) if core.stalled else self._inbox.get_nowait()) \
                    if core.busy else self._idle_wait()
            except queue.Empty:
                # with the point up to which host-tier copies are reaped: the same on every rank
                command, fut = commands.Step(core.tier.ready() if core.tier else 0), None
            if fut is not None and not fut.set_running_or_notify_cancel():
                continue  # the caller cancelled before the command ran: do not run it
            if core.lockstep is not None and command.published:
                core.lockstep.publish(command)  # the other ranks apply the same command in the same order
            self._run(command, fut)
        if core.fatal is not None:
            self.watchdog.dump(str(core.fatal))
        elif core.lockstep is not None:
            core.lockstep.publish(commands.Stop())
        try:
            core.disarm_all()  # (no transfer left queued behind a doorbell as the engine stops)
        except Exception:
            log.exception("engine: a transfer queued behind a doorbell could not be let go")
        self._refuse_queued()

    def _run(self, command: commands.Command, fut: Future | None) -> None:
        try:
            result = self.core.apply(command)
        except Exception as e:
            if fut is None:
                log.warning("engine: %s refused: %s", type(command).__name__, e)
            else:
                fut.set_exception(e)
        else:
            if isinstance(command, commands.AddRequest | commands.ImportRequest):
                self._futures[command.rid] = fut
            elif fut is not None:
                fut.set_result(result)
        if self._watches:
            self._notify()
        for out in self.core.take_finished():
            if (done := self._futures.pop(out.rid, None)) is not None and not done.done():
                done.set_result(out)

    def _notify(self) -> None:
        """Send each watched request's newly sampled tokens to its callback."""
        for rid, watch in list(self._watches.items()):
            if (delta := self.core.progress(rid, watch[1])) is not None:
                watch[1] = delta.start + len(delta.output_ids)
                try:
                    watch[0](delta)
                except Exception:
                    log.exception("engine: the watch callback of request %s failed", rid)

    def _idle_wait(self) -> tuple[commands.Command, Future | None]:
        """Nothing to run: wait for a command, and tell the watchdogs (ours and the followers') it is no hang."""
        if self.core.lockstep is not None:
            self.core.lockstep.publish(commands.Idle())
        t0 = time.perf_counter()
        with self.watchdog.idle():
            item = self._inbox.get()
        self.core.stats.idle_seconds += time.perf_counter() - t0
        return item

    def _refuse_queued(self) -> None:
        """After the loop ends, nobody may wait forever on a command that will never run or a request in it."""
        error = EngineError(f"engine stopped{f': {self.core.fatal}' if self.core.fatal else ''}")
        pending = list(self._futures.values())
        while True:
            try:
                pending.append(self._inbox.get_nowait()[1])
            except queue.Empty:
                break
        for fut in pending:
            if fut is not None and not fut.done() and (fut.running() or fut.set_running_or_notify_cancel()):
                fut.set_exception(error)
