"""The typed commands that drive an engine core (`tandem.engine.core.EngineCore.apply`).

Whoever drives a core (the async facade's thread, a tensor-parallel follower, later an expert-parallel rank or a
prefill/decode server) sends these and nothing else: no method names cross a process boundary. Rank 0 of a
tensor-parallel engine publishes every command whose `published` is true to the other ranks before applying it,
so all ranks apply the same sequence; a command that only reads state (`Snapshot`) stays local.

`drains`: the command needs every sampled token of the step in flight applied before it runs (it reads or changes
request state). A new request only joins the queue, and a weight load in place queues its copies behind the step
in flight, so those two do not wait for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from tandem.config import PAUSE_MODES, PauseMode
from tandem.types import SamplingParams

if TYPE_CHECKING:
    from torch import Tensor


MAX_VERSION = 2**53  # weight versions stay exact in JSON


@dataclass(frozen=True, slots=True)
class Command:
    published: ClassVar[bool] = True
    drains: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class AddRequest(Command):
    """Queue a request (validated by the caller). Its output arrives through `EngineCore.take_finished`.
    `export_kv_from` (a prefill server's request): its output also carries the KV of the positions from there
    (page-aligned) to the first it samples (`GenerateOutput.kv`, a `tandem.engine.kv_transfer.KVPages`).
    `prompt_len` (a continuation): the leading tokens of `input_ids` that are the prompt; the rest were generated
    before, so they count towards `max_new_tokens` and sampling continues at their position (its noise is a
    function of the seed and the position: see `tandem.engine.sampler`). None: all of them.
    `return_routed_experts`: its output carries the experts every layer routed each of its tokens to
    (`GenerateOutput.routed_experts`; the engine must keep them: `EngineConfig.enable_return_routed_experts`).
    `export_pinned` (with `export_kv_from`): the KV is exported in place, its pages pinned until the export is freed
    (`tandem.engine.kv_mapped.PinnedKV`), not copied."""

    drains: ClassVar[bool] = False
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    export_kv_from: int | None = None
    prompt_len: int | None = None
    return_routed_experts: bool = False
    export_pinned: bool = False  # export by pinning the pages (`kv_mapped.PinnedKV`), not a copy (`KVPages`)


@dataclass(frozen=True, slots=True)
class Probe(Command):
    """How many leading tokens of `input_ids` a decode server holds on its device in whole pages (what it need not
    be sent). With `rid`, the engine expects that request's `ImportRequest` from now on: an abort (of it, of all, or
    a pause in mode abort) before it arrives makes the import end at once with that abort; whoever probed must
    then send the import or `Abort(rid)`. It touches the cache's recency, so tensor-parallel ranks apply it too.
    `reserve` (with `rid`, an engine of one rank): also set aside the pages the import will fill (the cached ones
    referenced, fresh ones for the rest), so that its KV can be written out of the engine's thread as it lands
    (`EngineCore.write_reserved`); they go back with the import or `Abort(rid)`. None are set aside when none
    are free (the import then takes pages as it arrives)."""

    drains: ClassVar[bool] = False
    input_ids: list[int]
    rid: str | None = None
    reserve: bool = False


@dataclass(frozen=True, slots=True)
class ImportRequest(Command):
    """A decode server's request that a prefill server computed: its prompt `input_ids` and every token generated
    so far (`output_ids`, with their logprobs and weight versions; the last one the prefill server just sampled,
    earlier ones from before a hand-back), and the KV of its positions from `kv.start` to that last token (the
    positions before `kv.start` as `Probe` found them cached). `sampling.seed` must be set (the prefill server
    sampled with it). The request queues with its pages and decodes on from its last token; while the engine is
    paused the import waits for `Resume` (nothing is written into the pool while paused). Its output arrives
    through `EngineCore.take_finished`, as for `AddRequest`."""

    drains: ClassVar[bool] = False
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int]
    output_logprobs: list[float]
    weight_versions: list[int]
    kv: object  # KVPages
    return_routed_experts: bool = False  # (see `AddRequest`)


@dataclass(frozen=True, slots=True)
class Abort(Command):
    """Finish one request with finish reason abort (nothing if it is not in the engine)."""

    rid: str
    message: str = "aborted by request"


@dataclass(frozen=True, slots=True)
class AbortAll(Command):
    message: str = "aborted by request"


@dataclass(frozen=True, slots=True)
class Pause(Command):
    """`abort`: every request returns now; `retract`: running requests drop their KV and requeue; `in_place`: they
    freeze with their KV. Requests arriving while paused queue until `Resume`."""

    mode: PauseMode

    def __post_init__(self):
        check_pause_mode(self.mode)


@dataclass(frozen=True, slots=True)
class Resume(Command):
    pass


@dataclass(frozen=True, slots=True)
class LoadWeights(Command):
    """Load full (unsharded) tensors by Hugging Face name. `pause_mode` None: the engine must be paused already
    (`EngineError` otherwise) and stays paused. A mode: pause in that mode, load, resume (an engine already
    paused loads and stays paused); in place the copies queue behind the step in flight, whose tokens keep the
    old version. Returns the new version (`version`, or the current one plus 1) and the seconds paused. Versions
    never go backwards: one below the engine's current version is refused (ValueError) before anything loads."""

    drains: ClassVar[bool] = False
    named: Mapping[str, Tensor]
    version: int | None = None
    pause_mode: PauseMode | None = None

    def __post_init__(self):
        if self.pause_mode is not None:
            check_pause_mode(self.pause_mode)
        if self.version is not None and (not isinstance(self.version, int) or isinstance(self.version, bool)
                                         or not 0 <= self.version < MAX_VERSION):
            raise ValueError(f"weight_version: must be an integer in [0, 2**53), got {self.version!r}")


@dataclass(frozen=True, slots=True)
class FlushCache(Command):
    """Empty the prefix cache; refused (`EngineError`) while requests hold KV pages."""


@dataclass(frozen=True, slots=True)
class Step(Command):
    """Run one step. `tier_ready`: the host-tier copy up to which every rank reaps (rank 0 decides it)."""

    drains: ClassVar[bool] = False
    tier_ready: int = 0


@dataclass(frozen=True, slots=True)
class Idle(Command):
    """Rank 0 has nothing to run and waits for a command: the followers' wait is no hang."""

    drains: ClassVar[bool] = False


@dataclass(frozen=True, slots=True)
class Stop(Command):
    """The engine stops; followers leave their loop."""


@dataclass(frozen=True, slots=True)
class Snapshot(Command):
    """A copy of the engine's counters (`EngineStats`). Local to rank 0."""

    published: ClassVar[bool] = False


def check_pause_mode(mode) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode: must be one of {PAUSE_MODES}, got {mode!r}")
