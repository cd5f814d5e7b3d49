"""A request's state inside the engine (host side only)."""

from __future__ import annotations

import array
import enum
from concurrent.futures import Future
from dataclasses import dataclass, field

from tandem.types import FinishReason, GenerateOutput, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages (but an imported request its prompt's, see `EngineCore`)
    RUNNING = "running"  # holds pages; prefilling while num_computed < len(tokens) - 1, then decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    tokens: list[int]  # prompt, then every generated token appended
    prompt_len: int
    sampling: SamplingParams
    seed: int
    arrival: int  # admission order key: retraction picks the newest
    future: Future | None = None
    status: Status = Status.WAITING
    output_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # page table; position i lives in pages[i // page_size]
    num_computed: int = 0  # leading tokens whose KV is in `pages`
    # on the first admission: prompt tokens served from the cache (device plus host tier), and from the host tier
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    prefill_tokens: int = 0
    num_retractions: int = 0
    kv_stale: bool = False  # its KV predates a weight update (in_place pause): never share it
    pending_row: int = -1  # while its last token is PENDING: that token's index among the in-flight step's samples
    export_kv_from: int | None = None  # a prefill server's request: export its prompt's KV from here on
    return_routed_experts: bool = False
    # with `sampling.top_logprobs_num`: per output token, its distribution's most likely (logprob, token id) pairs
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    finish_reason: FinishReason | None = None
    _page_array: array.array | None = field(default=None, repr=False)

    def page_array(self) -> array.array:
        """`pages` as a C int array, for building block tables without converting every id every step. Pages
        appended are picked up here; whoever replaces or drops pages in place must call `pages_replaced`."""
        a = self._page_array
        if a is None or len(a) > len(self.pages):
            a = self._page_array = array.array("i", self.pages)
        elif len(a) < len(self.pages):
            a.extend(self.pages[len(a):])
        return a

    def pages_replaced(self) -> None:
        self._page_array = None

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def output(self, weight_version: int) -> GenerateOutput:
        return GenerateOutput(
            rid=self.rid, output_ids=self.output_ids, output_logprobs=list(self.output_logprobs),
            weight_versions=list(self.weight_versions), finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_len, cached_tokens=self.cached_tokens, prefill_tokens=self.prefill_tokens,
            host_cached_tokens=self.host_cached_tokens,
            num_retractions=self.num_retractions, weight_version=weight_version,
            output_top_logprobs=list(self.output_top_logprobs) if self.output_top_logprobs is not None else None)


def validate_request(input_ids, sampling: SamplingParams, rid: str, vocab: int, max_context_len: int,
                     kv_capacity: int) -> None:
    """Raise ValueError naming what is wrong with a request (its id, its tokens, its stop tokens, its length
    against the context and the KV pool's `kv_capacity` tokens)."""
    if not isinstance(rid, str) or not rid:
        raise ValueError("rid: must be a non-empty string")
    if not isinstance(input_ids, list | tuple) or not input_ids:
        raise ValueError("input_ids: must be a non-empty list of token ids")
    fine = all(type(t) is int for t in input_ids) and min(input_ids) >= 0 and max(input_ids) < vocab
    for i, t in enumerate(() if fine else input_ids):  # the slow path only to name what is wrong
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise ValueError(f"input_ids[{i}]: {t!r} is not a token id in [0, {vocab})")
    for t in sampling.stop_token_ids:
        if not 0 <= t < vocab:
            raise ValueError(f"sampling_params.stop_token_ids: {t} is not a token id in [0, {vocab})")
    total = len(input_ids) + sampling.max_new_tokens
    if total > max_context_len:
        raise ValueError(f"input_ids: prompt ({len(input_ids)} tokens) plus max_new_tokens "
                         f"({sampling.max_new_tokens}) exceeds the context length {max_context_len}")
    if total - 1 > kv_capacity:
        raise ValueError(f"input_ids: prompt plus max_new_tokens ({total}) exceeds the KV pool "
                         f"({kv_capacity} tokens)")


class Outbox:
    """The outputs of ended requests, each taken once it can be read: one whose routed experts an asynchronous copy
    is still bringing to the host (`KVPool.read_routing`) waits for its copy's event."""

    def __init__(self):
        self._ready: list[GenerateOutput] = []
        self._copying: list[tuple[object, GenerateOutput]] = []  # (the copy's CUDA event, the output)

    def put(self, out: GenerateOutput, copying=None) -> None:
        if copying is None:
            self._ready.append(out)
        else:
            self._copying.append((copying, out))

    def take(self, wait: bool) -> list[GenerateOutput]:
        """The outputs readable now, and with `wait` every other one too, after waiting for its copy."""
        copying, self._copying = self._copying, []
        for event, out in copying:
            if wait or event.query():
                event.synchronize()
                self._ready.append(out)
            else:
                self._copying.append((event, out))
        ready, self._ready = self._ready, []
        return ready
