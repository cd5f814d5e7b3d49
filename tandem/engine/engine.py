"""The engine: an async, token-in token-out generation API over a loop that runs in its own thread.

Every call from the caller's side only validates and enqueues a command; all engine state is touched by
the engine thread alone, so the caller's event loop never blocks on the engine and commands (pause,
weight updates, aborts) are ordered with steps. Many concurrent `generate` calls batch together.

Weight updates and the prefix cache: `update_weights` is allowed only while paused. By default it empties
the prefix cache, so no request reuses KV computed with older weights; requests frozen by `pause("in_place")` keep
their own old KV (the documented trade-off: their next tokens attend to KV of the previous weights) and never
share it with anyone. With `prefix_cache_max_age` N > 0 the cache is emptied only when an update would leave KV
in it (or in a running request that may share it) computed more than N updates ago: KV up to N updates old is
reused, as PipelineRL keeps in-flight KV; the sampled tokens' logprobs are those of the stale computation.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Literal

import torch

from tandem.config import EngineConfig, ModelConfig
from tandem.distributed import collectives
from tandem.distributed.flight_recorder import FlightRecorder
from tandem.distributed.parallel import SINGLE, TPGroup
from tandem.distributed.watchdog import Watchdog
from tandem.engine.host_tier import HostTier
from tandem.engine.kv_pool import KVPool, plan_kv_pages
from tandem.engine.model_runner import ModelRunner
from tandem.engine.radix_cache import PrefixLog, RadixCache
from tandem.engine.request import Request, Status, validate_request
from tandem.engine.scheduler import PENDING, Scheduler
from tandem.engine.tp import Lockstep, LockstepError, stable_hash, step_digest
from tandem.model.loader import WeightLoader, build_model
from tandem.model.qwen3 import Qwen3ForCausalLM
from tandem.transport.weights import NamedWeights, as_mapping
from tandem.types import PAUSED_ABORT, EngineStats, FinishReason, GenerateOutput, SamplingParams

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES = ("abort", "retract", "in_place")


def _check_pause_mode(mode) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode: must be one of {PAUSE_MODES}, got {mode!r}")


class EngineError(RuntimeError):
    """A request the engine refuses in its current state (not a malformed input: that is ValueError)."""


# commands that only read state: rank 0 runs them without publishing them to the other TP ranks
_LOCAL_COMMANDS = {"_snapshot", "<lambda>"}
# commands that need not wait for the step in flight: a load waits only when it needs its tokens; a new request only
# joins the queue, so arrivals (many a second in an agent run) keep the host a step ahead of the device
_DRAINING_ITSELF = {"_load_paused", "_add_request"}
SLOW_ITERATION_S = 0.2  # a step or command this long is logged: every request (and command) waited for it


class Engine:
    """`tp`: this rank's tensor-parallel group (see `tandem.engine.tp`). Rank 0 runs the loop in a thread and
    serves the API; the other ranks call `tandem.engine.tp.run_follower(engine)` in their main thread."""

    def __init__(self, model: str | ModelConfig | Qwen3ForCausalLM = "tiny", config: EngineConfig | None = None,
                 dtype: str | None = None, seed: int = 0, tp: TPGroup = SINGLE):
        self.config = config or EngineConfig()
        self.tp = tp
        self.lockstep = Lockstep(tp) if tp.size > 1 else None
        # always on: the last collectives and steps of this rank, and a dump when the loop stops progressing
        self.recorder = FlightRecorder(tp.rank, self.config.dump_dir, world_size=tp.size)
        collectives.set_recorder(self.recorder)
        timeout = self.config.watchdog_timeout_s
        self.watchdog = Watchdog(self.recorder, timeout or 1.0, action=self.config.watchdog_action,
                                 enabled=timeout > 0)
        self.watchdog.add_state("engine", lambda: {"running": len(self.scheduler.running), "paused": self.paused,
                                                   "queued": len(self.scheduler.waiting), "step": self.stats.num_steps})
        if self.lockstep is not None:
            self.watchdog.add_state("lockstep", lambda: self.lockstep.last_digest)
        if isinstance(model, Qwen3ForCausalLM):
            self.model = model.eval()
        else:
            self.model = build_model(model, device=self.config.device, dtype=dtype or "float32", seed=seed, tp=tp)
        self.model_config = self.model.config
        if self.config.fused_kernels and next(self.model.parameters()).is_cuda:
            self.model.use_fused_kernels()
        self.loader = WeightLoader(self.model)
        self.max_context_len = self.config.max_context_len or self.model_config.max_position_embeddings
        param = next(self.model.parameters())
        num_pages = self.config.num_pages or plan_kv_pages(self.model_config, self.config, param.dtype)
        self.pool = KVPool(self.model_config, num_pages, self.config.page_size, param.dtype, param.device,
                           num_kv_heads=self.model.model.layers[0].self_attn.num_kv_heads)
        self.tier = None
        if self.config.host_cache != "off":
            self.tier = HostTier(self.pool, self.config.host_cache_pages or 2 * num_pages, self.config.host_cache)
        self.cache = RadixCache(self.pool, self.tier) if self.config.enable_prefix_cache else None
        # the ideal to measure the cache against: every prefix computed, up to 4x what both tiers hold
        pool_tokens = (num_pages + (self.tier.num_pages if self.tier else 0)) * self.config.page_size
        self.ideal = PrefixLog(self.config.page_size, max(4 * pool_tokens, 1 << 20))
        self.scheduler = Scheduler(self.pool, self.cache, self.config, self.ideal)
        per_page = 2 * self.pool.k_cache[:, :self.config.page_size].numel() * param.element_size()
        log.info("KV cache: %d device pages of %d tokens (%.2f GiB)%s", num_pages, self.config.page_size,
                 num_pages * per_page / 2**30, f", {self.tier.num_pages} host pages ({self.tier.bytes / 2**30:.2f}"
                 f" GiB, {self.tier.policy})" if self.tier else "")
        self.runner = ModelRunner(self.model, self.pool, self.max_context_len, self.config)
        self.weight_version = 0
        self._cache_age = 0  # weight updates since the prefix cache was last emptied
        self.paused: PauseMode | None = None
        self.stats = EngineStats(pages_total=self.pool.num_pages)
        self._requests: dict[str, Request] = {}
        self._rng = random.Random(self.config.seed)
        self._arrival = itertools.count()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = False
        self._inflight = None  # the launched step whose sampled tokens are not applied yet
        self._last_chunks: list = []  # what the last step scheduled (named if it was slow)
        self._applied_digest = 0  # of the tokens the last drain applied (for the lockstep sentinel)
        self._fatal: Exception | None = None  # set when the engine must stop (TP ranks out of lockstep)
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self.watchdog.start()  # once built: loading a model is no stall
        if tp.rank == 0:
            self._thread.start()

    # ---- caller side: validation, then a command for the engine thread -----------------------------------
    async def generate(self, input_ids: list[int], sampling: SamplingParams | None = None,
                       rid: str | None = None) -> GenerateOutput:
        """Generate from `input_ids`. Raises ValueError for a malformed request (nothing is enqueued). If the
        awaiting task is cancelled (a client went away) the request is aborted and its pages freed."""
        sampling = sampling or SamplingParams()
        rid = rid if rid is not None else uuid.uuid4().hex
        if self._fatal is not None:
            raise EngineError(f"engine stopped: {self._fatal}")
        self.validate(input_ids, sampling, rid)
        fut: Future = Future()
        self._commands.put((self._add_request, (list(input_ids), sampling, rid, fut), None))
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(rid)
            raise

    def validate(self, input_ids, sampling: SamplingParams, rid: str) -> None:
        """Raise ValueError naming what is wrong with a request; submits nothing."""
        validate_request(input_ids, sampling, rid, self.model_config.vocab_size, self.max_context_len,
                         self.pool.num_pages * self.pool.page_size)

    def abort(self, rid: str) -> None:
        """Abort a request if it is still running or queued (it returns with finish reason abort)."""
        self._commands.put((self._abort, (rid, "aborted by request"), None))

    def abort_all(self) -> None:
        """Abort every running and queued request."""
        self._commands.put((self._abort_all, (), None))

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating. `abort`: in-flight and queued requests return at once (finish reason abort)
        with what they generated so far. `retract`: running requests drop their KV and go back to the
        queue, to be recomputed after `resume`. `in_place`: running requests freeze, keeping their KV.
        Requests arriving while paused queue until `resume`."""
        _check_pause_mode(mode)
        await self._call(self._pause, mode)

    async def resume(self) -> None:
        await self._call(self._resume)

    async def update_weights(self, named_tensors: NamedWeights, version: int | None = None) -> int:
        """Load full (unsharded) tensors by Hugging Face name while paused; returns the new weight version
        (`version`, or the current one plus 1). All tensors are checked before any is loaded. Empties
        the prefix cache (see the module docstring). An iterable is read here, a mapping (a transport's
        `FlatTensors`) by the engine's thread."""
        return await self._call(self._update_weights, as_mapping(named_tensors), version)

    async def load_paused(self, named_tensors: NamedWeights, version: int | None, pause_mode: PauseMode) -> float:
        """`update_weights` inside a pause in `pause_mode` (one already paused loads and stays paused), as one command.
        In place it does not wait for the step in flight: the copies queue behind it (its tokens keep the old
        version), so the tensors must not change until the device ran them. Returns the seconds paused."""
        _check_pause_mode(pause_mode)
        return await self._call(self._load_paused, as_mapping(named_tensors), version, pause_mode)

    async def flush_cache(self) -> None:
        """Empty the prefix cache. Refused (EngineError) while requests hold KV pages."""
        await self._call(self._flush_cache)

    async def get_stats(self) -> EngineStats:
        return await self._call(self._snapshot)

    def shutdown(self) -> None:
        self._stop = True
        self._commands.put((lambda: None, (), None))
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.watchdog.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    async def _call(self, fn: Callable, *args):
        if self._stop or not self._thread.is_alive():
            raise EngineError(f"engine stopped{f': {self._fatal}' if self._fatal else ''}")
        fut: Future = Future()
        self._commands.put((fn, args, fut))
        return await asyncio.wrap_future(fut)

    # ---- engine thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.pool.k_cache.is_cuda:  # events, streams and graphs of this thread belong to the engine's GPU
            torch.cuda.set_device(self.pool.k_cache.device)
        while not self._stop:
            busy = self.paused is None and (self.scheduler.running or self.scheduler.waiting)
            self.watchdog.bump()
            try:  # idle: sleep until a command arrives; busy: take one if there is one, else step
                cmd = self._commands.get_nowait() if busy else self._idle_wait()
            except queue.Empty:
                cmd = None
            if cmd is None:
                # with the point up to which host-tier copies are reaped: the same on every rank
                message = ("step", self.tier.ready() if self.tier else 0)
            else:
                fn, args, fut = cmd
                name = getattr(fn, "__name__", "")
                message = ("cmd", name, tuple(None if isinstance(a, Future) else a for a in args))
            if self.lockstep is not None and (cmd is None or name not in _LOCAL_COMMANDS):
                self.lockstep.publish(message)  # the other ranks apply the same message in the same order
            self._apply(message, cmd)
        if self.lockstep is not None and self._fatal is None:
            self.lockstep.publish(("stop",))
        self._refuse_queued()

    def _refuse_queued(self) -> None:
        """After the loop ends, nobody may wait forever on a command that will never run."""
        error = EngineError(f"engine stopped{f': {self._fatal}' if self._fatal else ''}")
        while True:
            try:
                _, args, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            for f in (fut, *args):
                if isinstance(f, Future) and f.set_running_or_notify_cancel():
                    f.set_exception(error)

    def _idle_wait(self):
        """Nothing to run: wait for a command, and tell the watchdogs (ours and the followers') it is no hang."""
        if self.lockstep is not None:
            self.lockstep.publish(("idle",))
        t0 = time.perf_counter()
        with self.watchdog.idle():
            cmd = self._commands.get()
        self.stats.idle_seconds += time.perf_counter() - t0
        return cmd

    def _apply(self, message, cmd=None) -> None:
        """Run one step, or one command (`cmd` on rank 0; followers rebuild it from the message)."""
        t0 = time.perf_counter()
        try:
            if message[0] == "step":
                if self.tier is not None:
                    self.tier.reap(message[1])
                with self.recorder.engine_step(self.stats.num_steps + 1):
                    self._step()
            else:
                if message[1] not in _DRAINING_ITSELF and self._inflight is not None:
                    self.stats.command_waits += 1
                    self._drain()  # commands see every sampled token
                self._run_command(*(cmd or (getattr(self, message[1]), message[2], None)))
        except Exception as e:  # an engine bug must not hang every client: fail them, keep serving
            log.exception("engine step failed")
            self._inflight = None
            if isinstance(e, LockstepError):  # the ranks disagree: stop, leaving the evidence
                self._fatal, self._stop = e, True
                self.watchdog.dump(str(e))
            self._abort_all(f"engine error: {e!r}")
        if (spent := time.perf_counter() - t0) > SLOW_ITERATION_S:
            chunks = self._last_chunks
            what = (f"command {message[1]}" if message[0] != "step" else
                    f"step {self.stats.num_steps} (requests {len(chunks)}, tokens {sum(c.num_tokens for c in chunks)})")
            log.warning("engine: %s took %.0f ms; every request waited for it", what, 1e3 * spent)

    def _run_command(self, fn, args, fut: Future | None) -> None:
        if fut is not None and not fut.set_running_or_notify_cancel():
            return  # the caller cancelled before the command ran: do not run it
        try:
            result = fn(*args)
        except Exception as e:
            if fut is None:
                log.exception("engine command %s failed", getattr(fn, "__name__", fn))
            else:
                fut.set_exception(e)
            return
        if fut is not None:
            fut.set_result(result)

    def _step(self) -> None:
        """Schedule and launch step n+1, then finish the bookkeeping of step n while the device runs n+1."""
        t0 = time.perf_counter()
        chunks = self._last_chunks = self.scheduler.schedule()
        if not chunks:
            self._drain()
            return
        t1 = time.perf_counter()
        launched = self.runner.launch(chunks, self._inflight)
        launched.version, t2 = self.weight_version, time.perf_counter()
        issued = self.tier.issued if self.tier is not None else 0
        for c in chunks:
            req = c.req
            req.num_computed += c.num_tokens
            if c.num_tokens > 1 or req.num_generated == 0:
                req.prefill_tokens += c.num_tokens
                self.stats.prefill_tokens_computed += c.num_tokens
        rows = iter(range(len(chunks)))
        for c in chunks:
            if c.sample:
                c.req.tokens.append(PENDING)
                c.req.pending_row = next(rows)
        self.scheduler.after_step(chunks)
        self.stats.num_steps += 1
        self.stats.decode_steps += all(c.num_tokens == 1 for c in chunks)
        self.stats.running_request_steps += len(chunks)
        self.stats.waiting_request_steps += len(self.scheduler.waiting)
        self.stats.schedule_seconds += t1 - t0
        self.stats.prepare_seconds += self.runner.last_prepare_seconds
        self.stats.forward_seconds += t2 - t1 - self.runner.last_prepare_seconds
        self.stats.busy_seconds += time.perf_counter() - t0
        self._drain()
        if self.tier is not None:  # every step before this one has finished now
            self.tier.settled_upto = issued
        self._inflight = launched
        if not self.config.overlap:
            self._drain()
        if self.lockstep is not None and self.config.lockstep_sentinel:
            t_check = time.perf_counter()
            self.lockstep.check(step_digest(self, chunks))
            self.stats.busy_seconds += time.perf_counter() - t_check

    def _drain(self) -> None:
        """Wait for the step in flight and apply its sampled tokens."""
        launched, self._inflight = self._inflight, None
        if launched is None:
            return
        t0 = time.perf_counter()
        tokens, logprobs = launched.result()
        t1 = time.perf_counter()
        sampled = iter(zip(tokens, logprobs, strict=True))
        for c in launched.chunks:
            if c.sample:
                token, logprob = next(sampled)
                if c.req.status is not Status.FINISHED:
                    self._append_token(c.req, c.start + c.num_tokens, token, logprob, launched.version)
        if self.lockstep is not None:
            self._applied_digest = stable_hash(tokens)
        self.stats.pages_free = self.pool.num_free
        self.stats.forward_seconds += t1 - t0
        self.stats.postprocess_seconds += time.perf_counter() - t1
        self.stats.busy_seconds += time.perf_counter() - t0

    def _append_token(self, req: Request, index: int, token: int, logprob: float, version: int) -> None:
        assert req.tokens[index] == PENDING, "sampled tokens resolve in order"
        req.tokens[index] = token
        req.output_logprobs.append(logprob)
        req.weight_versions.append(version)
        self.stats.generated_tokens += 1
        sp = req.sampling
        generated = index + 1 - req.prompt_len  # resolved so far (the next one may already be in flight)
        if token in sp.stop_token_ids or (not sp.ignore_eos and token == self.model_config.eos_token_id):
            self._finish(req, FinishReason("stop", matched=token))
        elif generated >= sp.max_new_tokens:
            self._finish(req, FinishReason("length", length=generated))

    def _add_request(self, input_ids, sampling: SamplingParams, rid: str, fut: Future) -> None:
        try:
            self._enqueue(input_ids, sampling, rid, fut)
        except Exception as e:  # never leave a caller waiting on a request the engine lost
            if fut is not None and not fut.done():
                fut.set_exception(e)
            raise

    def _enqueue(self, input_ids, sampling: SamplingParams, rid: str, fut: Future) -> None:
        if rid in self._requests:
            if fut is not None:
                fut.set_exception(ValueError(f"rid: {rid!r} is already in flight"))
            return
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
        req = Request(rid, input_ids, len(input_ids), sampling, seed, next(self._arrival), fut)
        self._requests[rid] = req
        self.scheduler.waiting.append(req)
        if sampling.max_new_tokens == 0:
            self._finish(req, FinishReason("length", length=0))

    def _finish(self, req: Request, reason: FinishReason) -> None:
        # a stop token ends the request, and the token the in-flight step sampled after it is dropped
        if PENDING in req.tokens:
            del req.tokens[req.tokens.index(PENDING):]
            req.num_computed = min(req.num_computed, len(req.tokens))
        self.scheduler.remove(req)
        req.finish_reason = reason
        self._requests.pop(req.rid, None)
        self.stats.num_finished += 1
        self.stats.num_aborted += reason.type == "abort"
        if req.future is not None and not req.future.done():
            req.future.set_result(req.output(self.weight_version))

    def _abort(self, rid: str, message: str) -> None:
        req = self._requests.get(rid)
        if req is not None:
            self._finish(req, FinishReason("abort", message=message))

    def _abort_all(self, message: str = "aborted by request") -> None:
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(req, FinishReason("abort", message=message))

    def _pause(self, mode: PauseMode) -> None:
        if mode == "abort":
            self._abort_all(PAUSED_ABORT)
        elif mode == "retract":
            for req in reversed(list(self.scheduler.running)):
                self.scheduler.retract(req)
        self.paused = mode

    def _resume(self) -> None:
        self.paused = None

    def _update_weights(self, named: Mapping[str, torch.Tensor], version: int | None) -> int:
        if self.paused is None:
            raise EngineError("update_weights: the engine must be paused first (pause_generation)")
        if version is not None and (not isinstance(version, int) or version < 0):
            raise ValueError(f"weight_version: must be a non-negative integer, got {version!r}")
        self.loader.load(named)  # checks every tensor before it loads any
        if self._update_empties_cache():
            self._mark_stale()
            self._empty_cache()
        else:
            self._cache_age += 1
        self.stats.weight_version = self.weight_version = self.weight_version + 1 if version is None else version
        return self.weight_version

    def _load_paused(self, named: Mapping[str, torch.Tensor], version: int | None, mode: PauseMode) -> float:
        t0, already_paused = time.perf_counter(), self.paused is not None
        if mode != "in_place":  # in place, the copies queue behind the step in flight; its tokens keep their version
            self._drain()
        if not already_paused:
            if self._update_empties_cache():  # retracting or aborting must not insert KV of the weights replaced
                self._mark_stale()
            self._pause(mode)
        try:
            self._update_weights(named, version)
        finally:
            if not already_paused:
                self._resume()
        return time.perf_counter() - t0

    def _flush_cache(self) -> None:
        if holders := len(self.scheduler.running):
            raise EngineError(f"flush_cache: refused while {holders} request(s) hold KV pages; wait for them "
                              "or pause with mode abort/retract first")
        self._empty_cache()

    def _update_empties_cache(self) -> bool:
        """Whether the next weight update would age the KV computed before it past `prefix_cache_max_age`."""
        return self._cache_age + 1 > self.config.prefix_cache_max_age

    def _mark_stale(self) -> None:
        for req in self.scheduler.running:  # (frozen in place: they keep it, and never share it)
            req.kv_stale = True

    def _empty_cache(self) -> None:
        if self.cache is not None:
            self.cache.reset()
        self.ideal.reset()  # nothing computed before is reusable now
        self._cache_age = 0

    def _snapshot(self) -> EngineStats:
        s, sched = self.stats, self.scheduler
        s.num_running, s.num_queued = len(sched.running), len(sched.waiting)
        s.num_paused = s.num_running + s.num_queued if self.paused else 0
        s.num_retractions = sched.num_retractions
        s.prefill_tokens_cached, s.prefill_tokens_host = sched.num_cached_tokens, sched.num_host_tokens
        s.prompt_tokens, s.prompt_tokens_cached = sched.num_prompt_tokens, sched.num_prompt_cached_tokens
        s.prompt_tokens_ideal = sched.num_ideal_tokens
        if self.tier is not None:
            s.host_pages_total, s.host_pages_free = self.tier.num_pages, self.tier.num_free
            s.host_pages_loaded, s.host_pages_backed_up = self.tier.pages_loaded, self.tier.pages_backed_up
        s.pages_free, s.pages_cached = self.pool.num_free, self.cache.num_pages if self.cache else 0
        return EngineStats(**{f: getattr(s, f) for f in s.__dataclass_fields__})
