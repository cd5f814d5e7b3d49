"""The engine core: the state machine that owns every piece of engine state, driven by typed commands.

`apply(command)` is the whole interface (`tandem.engine.commands`); requests that end come out of
`take_finished()`. It does not block on anyone and owns no thread: the async facade (`tandem.engine.engine`) drives
it from its thread on rank 0, and a tensor-parallel follower (`tandem.run.tp`) applies the commands rank 0
published, in the same order, to its own core.

A step schedules (`Scheduler.schedule`), launches the model on the chunks (`ModelRunner.launch`, which returns
before the device finishes), does the scheduler's bookkeeping, and then applies the previous step's sampled tokens
while the device runs this one (overlap).

Weight updates and the prefix cache: loading is allowed only while paused. By default it empties the prefix cache,
so no request reuses KV computed with older weights; requests frozen by an `in_place` pause keep their own old KV
(the documented trade-off: their next tokens attend to KV of the previous weights) and never share it with
anyone. With `prefix_cache_max_age` N > 0 the cache is emptied only when an update would leave KV in it (or in a
running request that may share it) computed more than N updates ago: KV up to N updates old is reused, as
PipelineRL keeps in-flight KV; the sampled tokens' logprobs are those of the stale computation.

Prefill/decode disaggregation: a prefill server's request (`AddRequest.export_kv_from`) hands its prompt's KV out
with its output, read from its pages as it finishes (or its pages pinned until `unpin`: `export_pinned`); a decode
server's `ImportRequest` writes such KV into fresh pages (behind the cached ones it already held) and queues the
request with them and its first token: admitted, it decodes at once, and its KV joins the prefix cache when it ends,
as any request's does. Both ends run between steps in this thread: no page is freed or reused while its content
moves. While paused, imports wait (`_held`) and nothing is written; `Resume` places them, an abort pause ends them.
A decode server's engine (`EngineConfig.role`) hands its running requests back when it pauses in mode retract, and
an import whose KV is of other weights than it holds: they end with `HANDED_BACK`, and its server has a prefill
server compute them again.

Isolation: a request whose inputs make a step fail (a value the validation let through) is identified and
finished with an abort naming the error; the step's other requests are not touched and run in the next step. Only
a failure no single request explains fails every request (and is logged as an engine error).
"""

from __future__ import annotations

import collections
import itertools
import logging
import random
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from tandem.config import EngineConfig, ModelConfig, PauseMode
from tandem.distributed import collectives
from tandem.distributed.flight_recorder import FlightRecorder
from tandem.distributed.parallel import SINGLE, TPGroup
from tandem.engine import commands
from tandem.engine.core_imports import DecodeImports, Reservation
from tandem.engine.host_tier import HostTier
from tandem.engine.kv_index_sums import record_sums_by_index
from tandem.engine.kv_mapped import MappedKV, PinnedKV, pin_pages
from tandem.engine.kv_pool import KVPool, plan_kv_pages
from tandem.engine.kv_transfer import KVPages, read_pages
from tandem.engine.lockstep import Lockstep, LockstepError, stable_hash, step_digest
from tandem.engine.model_runner import Launched, ModelRunner, StepInputError
from tandem.engine.observers import IdealReuse
from tandem.engine.radix_cache import RadixCache
from tandem.engine.request import Outbox, Request, Status
from tandem.engine.scheduler import PENDING, Chunk, Scheduler
from tandem.engine.streams import StreamRuntime, engine_placements
from tandem.holds import HoldWatch
from tandem.model.loader import WeightLoader, build_model
from tandem.model.qwen3 import Qwen3ForCausalLM
from tandem.types import HANDED_BACK, PAUSED_ABORT, EngineStats, FinishReason, GenerateOutput, TokenDelta

log = logging.getLogger(__name__)

SLOW_ITERATION_S = 0.2  # a step or command this long is logged: every request (and command) waited for it


class EngineError(RuntimeError):
    """A request the engine refuses in its current state (not a malformed input: that is ValueError)."""


class EngineCore(DecodeImports):
    """`tp`: the group of the engine's ranks (`TPGroup`: tensor and expert parallelism). On rank 0 of a
    multi-rank engine, `lockstep` publishes each command."""

    def __init__(self, model: str | ModelConfig | Qwen3ForCausalLM = "tiny", config: EngineConfig | None = None,
                 dtype: str | None = None, seed: int = 0, tp: TPGroup = SINGLE):
        self.config = config = config or EngineConfig()
        self.tp = tp
        self.lockstep = Lockstep(tp) if tp.size > 1 else None
        # always on: the last collectives and steps of this rank (the watchdog dumps them when the loop stalls)
        self.recorder = FlightRecorder(tp.rank, config.dump_dir, world_size=tp.size)
        collectives.set_recorder(self.recorder)
        if isinstance(model, Qwen3ForCausalLM):
            self.model = model.eval()
        else:
            self.model = build_model(model, device=config.device, dtype=dtype or "float32", seed=seed,
                                     tp=tp.dense_group, ep=tp.expert_group)
        self.model_config = self.model.config
        if tp.size > 1 and self.model.moe_blocks:  # the sentinel compares the ranks' routing too
            self.model.keep_routing_checksum()
        if config.fused_kernels and next(self.model.parameters()).is_cuda:
            self.model.use_fused_kernels(small=config.small_batch_kernels)
        self.loader = WeightLoader(self.model)
        self.max_context_len = config.max_context_len or self.model_config.max_position_embeddings
        param = next(self.model.parameters())
        num_pages = config.num_pages or plan_kv_pages(self.model_config, config, param.dtype)
        if config.enable_return_routed_experts and not self.model.moe_blocks:
            raise ValueError("engine.enable_return_routed_experts: the model has no mixture-of-experts layers")
        self.pool = KVPool(self.model_config, num_pages, config.page_size, param.dtype, param.device,
                           num_kv_heads=self.model.model.layers[0].self_attn.num_kv_heads,
                           routing=config.enable_return_routed_experts, shared=config.role == "prefill",
                           slot_sums=config.role == "prefill")
        if self.pool.routing is not None:
            self.model.capture_routing(self.pool.routing)
        if self.pool.sums is not None:  # (an export's checksums without a pass over its KV: `kv_mapped`)
            self.model.capture_kv_sums(self.pool.record_sums)
        if config.role == "decode":  # (the kernel summing a prefill server's records compiled now, not at an import)
            L, P = self.model_config.num_hidden_layers, config.page_size
            record_sums_by_index(torch.zeros((P, L, 2), dtype=torch.int64, device=param.device), [0], 0, 1, P)
        self.order = StreamRuntime(engine_placements(), param.device)  # where each piece of device work runs
        self.tier = HostTier(self.pool, config.host_cache_pages or 2 * num_pages, config.host_cache,
                             order=self.order, copy=config.host_cache_copy if param.is_cuda else "staged"
                             ) if config.host_cache != "off" else None
        self.cache = RadixCache(self.pool, self.tier) if config.enable_prefix_cache else None
        self.ideal = None  # what the cache is measured against: every prefix computed, up to 4x what both tiers hold
        if config.measure_ideal_reuse:
            pool_tokens = (num_pages + (self.tier.num_pages if self.tier else 0)) * config.page_size
            self.ideal = IdealReuse(config.page_size, max(4 * pool_tokens, 1 << 20))
        self.scheduler = Scheduler(self.pool, self.cache, config, self.model_config.eos_token_id, self.ideal)
        per_page = 2 * self.pool.k_cache[:, :config.page_size].numel() * param.element_size()
        log.info("KV cache: %d device pages of %d tokens (%.2f GiB)%s", num_pages, config.page_size,
                 num_pages * per_page / 2**30, f", {self.tier.num_pages} host pages ({self.tier.bytes / 2**30:.2f}"
                 f" GiB, {self.tier.policy})" if self.tier else "")
        self.runner = ModelRunner(self.model, self.pool, self.max_context_len, config, tp, self.order)
        self.weight_version = 0
        self.paused: PauseMode | None = None  # the pause mode while paused
        self.stats = EngineStats(pages_total=self.pool.num_pages)
        self.fatal: Exception | None = None  # set when the engine must stop (TP ranks out of lockstep)
        self._cache_age = 0  # weight updates since the prefix cache was last emptied
        self.load_gap_s: float | None = None  # host seconds from the last load's start to its first step's launch
        self._load_started: float | None = None
        self._requests: dict[str, Request] = {}
        self._outbox = Outbox()
        self._rng = random.Random(config.seed)
        self._arrival = itertools.count()
        self._inflight: Launched | None = None  # the launched step whose sampled tokens are not applied yet
        self._last_chunks: list[Chunk] = []  # what the last step scheduled (named if it was slow)
        self._hold_watch = HoldWatch(SLOW_ITERATION_S)  # (and where the thread was, if so)
        self._applied_digest = 0  # of the tokens the last drain applied (for the lockstep sentinel)
        self._applied_routing = 0  # the model's routing checksum after the step the last drain applied
        self._held: list[tuple[Request, KVPages | MappedKV]] = []  # imports that arrived while paused, in order
        self._pinned_exports: set[str] = set()  # requests whose KV is exported by pinning its pages (`pin_pages`)
        self._unpins: collections.deque[list[int]] = collections.deque()  # pinned pages let go (any thread)
        self._expected: dict[str, str | None] = {}  # probed imports not yet arrived -> the abort that ended them
        self._reserved: dict[str, Reservation] = {}  # pages set aside for probed imports (`Probe(reserve=True)`)
        self._gate = threading.RLock()  # held by a write out of this thread, and to pause or drop a reservation
        # a prefill server's: called with (rid, PinnedKV, its weight version) as an export is pinned (as its step is
        # launched), then with (rid, PinnedKV) once it is ready to read; quick, in this thread (`disagg_mailbox`)
        self.on_pinned = self.on_ready = None
        self._early: dict[str, PinnedKV] = {}  # exports pinned as their step was launched (`_pin_launched`)
        # the last step scheduled nothing with nothing in flight: requests wait for pages another holds (a pinned
        # export, a copy); the engine's loop waits a little for a command before it steps again
        self.stalled = False
        if self.lockstep is not None:
            self.lockstep.ready()

    @property
    def busy(self) -> bool:
        """Whether a step would do anything (not paused, requests in the engine)."""
        return self.paused is None and bool(self.scheduler.running or self.scheduler.waiting)

    def take_finished(self) -> list[GenerateOutput]:
        """The outputs of the requests that ended since the last call (finished, stopped or aborted), each once it
        can be read (`Outbox`: routed experts still on their way wait, but not when no step is left to overlap)."""
        return self._outbox.take(wait=not self.busy)

    def progress(self, rid: str, start: int) -> TokenDelta | None:
        """The output tokens of request `rid` sampled so far from index `start` on (those of steps applied), or None
        when there are none beyond `start` or the request is not in the engine (finished: its output has them)."""
        req = self._requests.get(rid)
        if req is None or len(req.output_logprobs) <= start:
            return None
        end = len(req.output_logprobs)
        top = req.output_top_logprobs[start:end] if req.output_top_logprobs is not None else None
        return TokenDelta(rid, start, req.tokens[req.prompt_len + start:req.prompt_len + end],
                          req.output_logprobs[start:end], req.weight_versions[start:end], top)

    # ---- commands ------------------------------------------------------------------------------------------
    def apply(self, command: commands.Command) -> Any:
        """Apply one command and return its result. A command's own refusal (ValueError, EngineError) is raised to
        the caller and changes nothing (a step raises nothing). An error of the engine itself is logged and fails
        every request in it (a bug must not leave clients waiting); ranks out of lockstep also set `fatal`: the
        engine must stop."""
        t0 = time.perf_counter()
        self._hold_watch.begin()
        while self._unpins:  # (before any command that could allocate)
            self.pool.decref(self._unpins.popleft())
        if not isinstance(command, commands.Step):
            self.stalled = False  # (it may have changed what a step can do)
        try:
            if command.drains and self._inflight is not None:
                self.stats.command_waits += 1
                self._drain()  # commands see every sampled token
            match command:
                case commands.Step(tier_ready=ready):
                    with self.recorder.engine_step(self.stats.num_steps + 1):
                        self._step(ready)
                case commands.AddRequest():
                    self._add_request(command)
                case commands.ImportRequest():
                    self._import_request(command)
                case commands.Probe(input_ids=ids, rid=rid, reserve=reserve):
                    if rid is not None:
                        self._expected[rid] = None
                    return self._probe(ids, rid if reserve else None)
                case commands.Abort(rid=rid, message=message):
                    if (req := self._requests.get(rid)) is not None:
                        self._finish(req, FinishReason("abort", message=message))
                    self._expected.pop(rid, None)
                    self._release(self._take_reservation(rid))
                case commands.AbortAll(message=message):
                    self._abort_all(message)
                case commands.Pause(mode=mode):
                    self._pause(mode)
                case commands.Resume():
                    self.paused = None
                    held, self._held = self._held, []
                    for req, kv in held:
                        self._place_import(req, kv)
                case commands.LoadWeights():
                    return self._load_weights(command)
                case commands.FlushCache():
                    self._flush_cache()
                case commands.Snapshot():
                    return self._snapshot()
                case commands.Idle() | commands.Stop():
                    pass
                case _:
                    raise EngineError(f"not an engine command: {command!r}")
        except Exception as e:
            if isinstance(e, ValueError | EngineError) and not isinstance(command, commands.Step):
                raise  # the command's own refusal
            self._engine_error(e)
        finally:
            where, s = self._hold_watch.end(), self.stats
            if (spent := time.perf_counter() - t0) > SLOW_ITERATION_S:
                chunks = self._last_chunks
                what = (f"step {s.num_steps} (requests {len(chunks)}, tokens {sum(c.num_tokens for c in chunks)})"
                        if isinstance(command, commands.Step) else f"command {type(command).__name__}")
                log.warning("engine: %s took %.0f ms; every request waited for it; held in: %s", what, 1e3 * spent,
                            where or "(not taken)")
                s.slow_iterations += 1
                s.slowest_iteration_seconds = max(s.slowest_iteration_seconds, spent)

    def _engine_error(self, error: Exception) -> None:
        log.error("engine step failed", exc_info=error)
        self._inflight = None
        if isinstance(error, LockstepError):  # the ranks disagree: stop, leaving the evidence
            self.fatal = error
        self._abort_all(f"engine error: {error!r}")

    def _add_request(self, cmd: commands.AddRequest) -> None:
        if cmd.rid in self._requests:
            raise ValueError(f"rid: {cmd.rid!r} is already in flight")
        sampling, start, n = cmd.sampling, cmd.export_kv_from, len(cmd.input_ids)
        if start is not None and not (0 <= start <= n and start % self.pool.page_size == 0):
            raise ValueError(f"export_kv_from: must be a multiple of the page size ({self.pool.page_size}) in "
                             f"[0, {n}], got {start}")
        prompt_len = n if cmd.prompt_len is None else cmd.prompt_len
        if not 1 <= prompt_len <= n:
            raise ValueError(f"prompt_len: must be in [1, {n}] (the input's leading tokens), got {prompt_len}")
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
        req = Request(cmd.rid, list(cmd.input_ids), prompt_len, sampling, seed, next(self._arrival))
        if cmd.return_routed_experts and self.pool.routing is None:
            raise ValueError("return_routed_experts: this engine keeps no routing (start it with "
                             "enable_return_routed_experts)")
        if cmd.export_pinned and (start is None or self.tp.size > 1):
            raise ValueError("export_pinned: only with export_kv_from, on an engine of one rank (pages are pinned "
                             "in rank 0's allocator alone)")
        req.export_kv_from, req.return_routed_experts = start, cmd.return_routed_experts
        if cmd.export_pinned:
            self._pinned_exports.add(cmd.rid)
        self._requests[cmd.rid] = req
        self.scheduler.waiting.append(req)
        if sampling.max_new_tokens == 0:
            self._finish(req, FinishReason("length", length=0))

    def _finish(self, req: Request, reason: FinishReason) -> None:
        kv = routed = copying = None
        pinned = req.rid in self._pinned_exports
        self._pinned_exports.discard(req.rid)
        if held := [kv for r, kv in self._held if r is req]:
            for kv_held in held:
                kv_held.settle()
            self._held = [(r, pages) for r, pages in self._held if r is not req]
            req.status, req.finish_reason = Status.FINISHED, reason
        else:
            exporting = (req.export_kv_from is not None and reason.type != "abort"
                         and req.num_computed == len(req.tokens) - 1)
            if (kv := self._take_early(req, exporting)) is None and exporting:  # (else pinned as launched)
                with self.order.work("kv_export"):
                    kv = (pin_pages(self.pool, req.pages, req.export_kv_from, req.num_computed, self.unpin) if pinned
                          else read_pages(self.pool, req.pages, req.export_kv_from, req.num_computed,
                                          self.pool.k_cache.device))
                if pinned and req.weight_versions:  # (ready now: its step has run)
                    kv.ready_at = time.monotonic()
                    self._tell(self.on_pinned, req.rid, kv, req.weight_versions[-1])
                    if kv.is_recorded():  # (else its records wait behind the next step: the answer's way)
                        self._tell(self.on_ready, req.rid, kv)
            if req.return_routed_experts:  # every token but the last (those of the cache: as they were computed)
                known = req.tokens.index(PENDING) if PENDING in req.tokens else len(req.tokens)
                routed, copying = self.pool.read_routing(req.pages, min(req.num_computed, known - 1))
            self.scheduler.finish(req, reason)
        self._requests.pop(req.rid, None)
        self.stats.num_finished += 1
        self.stats.num_aborted += reason.type == "abort"
        out = req.output(self.weight_version)
        out.kv, out.routed_experts = kv, routed
        self._outbox.put(out, copying)

    def _abort_all(self, message: str) -> None:
        self._expected = dict.fromkeys(self._expected, message)
        for req in [*self.scheduler.running, *self.scheduler.waiting, *(req for req, _ in self._held)]:
            self._finish(req, FinishReason("abort", message=message))

    def _pause(self, mode: PauseMode) -> None:
        if mode == "abort":
            self._abort_all(PAUSED_ABORT)
        elif mode == "retract" and self.config.role == "decode":  # recomputed at a prefill server, new weights
            for req in list(self.scheduler.running):
                self._finish(req, FinishReason("abort", message=HANDED_BACK))
        elif mode == "retract":
            for req in reversed(list(self.scheduler.running)):
                self.scheduler.retract(req)
            self._void_early()
        with self._gate:  # (after a write out of this thread in flight is checked: none starts after it)
            self.disarm_all()  # (an armed pass runs now, its result taken by nobody)
            self.paused = mode

    def _load_weights(self, cmd: commands.LoadWeights) -> tuple[int, float]:
        t0, mode = time.perf_counter(), cmd.pause_mode
        if cmd.version is not None and cmd.version < self.weight_version:
            raise ValueError(f"weight_version: {cmd.version} is older than the engine's version {self.weight_version}")
        if mode is None and self.paused is None:
            raise EngineError("update_weights: the engine must be paused first (pause_generation)")
        pausing = mode is not None and self.paused is None
        if mode != "in_place":  # in place, the copies queue behind the step in flight; its tokens keep their version
            self._drain()
        if pausing:
            if self._update_empties_cache():  # retracting or aborting must not insert KV of the weights replaced
                self._mark_stale()
            self._pause(mode)
        try:
            self._update_weights(cmd.named, cmd.version)
            self._load_started = t0
        finally:
            if pausing:
                self.paused = None
        return self.weight_version, time.perf_counter() - t0

    def _update_weights(self, named: Mapping[str, torch.Tensor], version: int | None) -> None:
        with self.order.work("weights_load"):
            self.loader.load(named)  # checks every tensor before it loads any
        if self._update_empties_cache():
            self._mark_stale()
            self._empty_cache()
        else:
            self._cache_age += 1
        self.stats.weight_version = self.weight_version = self.weight_version + 1 if version is None else version

    def _flush_cache(self) -> None:
        if holders := len(self.scheduler.running):
            raise EngineError(f"flush_cache: refused while {holders} request(s) hold KV pages; wait for them "
                              "or pause with mode abort/retract first")
        if self.tier is not None:  # copies still hold pages until reaped (an idle engine takes no step to reap)
            self.tier.retire_all()
            self.tier.reap()
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
        if self.ideal is not None:
            self.ideal.cache_emptied()
        self._cache_age = 0

    # ---- the step ------------------------------------------------------------------------------------------
    def _step(self, tier_ready: int) -> None:
        """Schedule and launch step n+1, then apply step n's tokens while the device runs n+1."""
        t0 = time.perf_counter()
        if self.tier is not None:
            self.tier.reap(tier_ready)  # (and its queued backups go out: scheduling time)
        chunks = self._last_chunks = self.scheduler.schedule()
        if self._early:  # (a retraction may have taken one)
            self._void_early()
        if not chunks:  # (stalled: nothing in flight either, so nothing this step did can let the next one on)
            self.stalled = self._inflight is None
            self._drain()
            return
        self.stalled = False
        t1 = time.perf_counter()
        if self._load_started is not None:
            self.load_gap_s, self._load_started = t1 - self._load_started, None
        try:
            launched = self.runner.launch(chunks, self._inflight)
        except StepInputError as e:
            self._fail_culprits(chunks, e)
            return
        launched.version, t2 = self.weight_version, time.perf_counter()
        self._record_step(chunks, self.scheduler.advance(chunks), t0, t1, t2)
        if self._pinned_exports:
            self._pin_launched(launched)
        self._drain()  # (its time counts as busy by itself)
        self._inflight = launched
        if not self.config.overlap:
            self._drain()
        if self.tier is not None:  # the step's backups (prefixes published, requests finished), and the next
            t3 = time.perf_counter()  # waiting requests' prefetches, while it runs
            self.tier.flush()
            self.scheduler.prefetch()
            self.stats.busy_seconds += time.perf_counter() - t3
        if self.lockstep is not None and self.config.lockstep_sentinel:
            t_check = time.perf_counter()
            tier = (self.tier.num_free, self.tier.in_flight) if self.tier else None
            self.lockstep.check(step_digest(
                self.stats.num_steps, [r.rid for r in self.scheduler.running],
                [(c.req.rid, c.start, c.num_tokens) for c in chunks], self._applied_digest, self.stats.num_finished,
                tier, self._applied_routing))
            self.stats.busy_seconds += time.perf_counter() - t_check

    def _fail_culprits(self, chunks: list[Chunk], error: StepInputError) -> None:
        """A step's inputs could not be built: finish the requests whose own inputs fail (the same on every rank),
        leave the others for the next step. If no request fails on its own, it is the engine's error."""
        culprits = [(c.req, why) for c in chunks if (why := self.runner.check_inputs(c.req)) is not None]
        if not culprits:
            raise error
        for req, why in culprits:
            log.warning("engine: request %s failed its step's inputs (%s); the other requests go on", req.rid, why)
            self._finish(req, FinishReason("abort", message=f"invalid request: {why}"))

    def _record_step(self, chunks: list[Chunk], num_prefill: int, t0: float, t1: float, t2: float) -> None:
        s = self.stats
        s.num_steps += 1
        s.decode_steps += all(c.num_tokens == 1 for c in chunks)
        s.prefill_tokens_computed += num_prefill
        s.running_request_steps += len(chunks)
        s.waiting_request_steps += len(self.scheduler.waiting)
        s.schedule_seconds += t1 - t0
        s.prepare_seconds += self.runner.last_prepare_seconds
        s.forward_seconds += t2 - t1 - self.runner.last_prepare_seconds
        s.busy_seconds += time.perf_counter() - t0

    def _drain(self) -> None:
        """Wait for the step in flight and apply its sampled tokens."""
        launched, self._inflight = self._inflight, None
        if launched is None:
            return
        t0 = time.perf_counter()
        tokens, logprobs = launched.result()
        if self._early:
            self._exports_ready(launched)
        tops = launched.top_result() or [None] * len(tokens)
        t1 = time.perf_counter()
        sampled = iter(zip(tokens, logprobs, tops, strict=True))
        for c in launched.chunks:
            if c.sample:
                token, logprob, top = next(sampled)
                if c.req.status is not Status.FINISHED:
                    self.stats.generated_tokens += 1
                    reason = self.scheduler.resolve(c.req, c.start + c.num_tokens, token, logprob, launched.version,
                                                    top)
                    if reason is not None:
                        self._finish(c.req, reason)
        if self.lockstep is not None:
            self._applied_digest, self._applied_routing = stable_hash(tokens), launched.routing_value()
        self.stats.pages_free = self.pool.num_free
        self.stats.forward_seconds += t1 - t0
        self.stats.postprocess_seconds += time.perf_counter() - t1
        self.stats.busy_seconds += time.perf_counter() - t0

    def _snapshot(self) -> EngineStats:
        s, sched = self.stats, self.scheduler
        s.num_running, s.num_queued = len(sched.running), len(sched.waiting)
        s.num_paused = s.num_running + s.num_queued if self.paused else 0
        s.num_retractions = sched.num_retractions
        s.prefill_tokens_cached, s.prefill_tokens_host = sched.num_cached_tokens, sched.num_host_tokens
        s.prompt_tokens, s.prompt_tokens_cached = sched.num_prompt_tokens, sched.num_prompt_cached_tokens
        s.ideal_measured = self.ideal is not None
        s.prompt_tokens_ideal = self.ideal.ideal_tokens if self.ideal is not None else 0
        if self.tier is not None:
            s.host_pages_total, s.host_pages_free = self.tier.num_pages, self.tier.num_free
            s.host_pages_loaded, s.host_pages_backed_up = self.tier.pages_loaded, self.tier.pages_backed_up
        s.pages_free, s.pages_cached = self.pool.num_free, self.cache.num_pages if self.cache else 0
        return EngineStats(**{f: getattr(s, f) for f in s.__dataclass_fields__})
