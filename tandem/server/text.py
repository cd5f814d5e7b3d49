"""Text at the edges of a token-in token-out engine: a request's output decoded as its tokens arrive, stop strings,
and the one generate that both SGLang's `/generate` and the OpenAI endpoints run.

Contract (`generate` / `generate_stream`): a request is submitted as it is (its token ids); when it has stop strings
(`SamplingParams.stop`, a tokenizer needed) or is streamed, the server watches its tokens as steps sample them
(`Engine.watch`), decodes them one at a time, and the first token after which the decoded output contains a stop
string ends it: the engine is told to abort it, and its output is cut right after that token (ids, logprobs,
versions, top logprobs, routed experts), its finish reason `{"type": "stop", "matched": <the string>}` as SGLang's.
The engine may have sampled a few tokens more before the abort landed; they are dropped (their KV may stay in the
prefix cache: the same tokens under the same weights, harmless). The returned `text` is the output decoded with the
request's `skip_special_tokens` / `spaces_between_special_tokens`; unless `no_stop_trim`, a matched stop string and
what follows it are trimmed from the text, and so is the text of a stop token (EOS or `stop_token_ids`) that ended
it; with `no_stop_trim` the text keeps the stop string (and nothing after it). `output_ids` always keep every token
sampled up to the stop, the stop token included: RL trains on exactly those.

Without a tokenizer `text` is "" and stop strings are refused (`check_text`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable

from tandem.engine.engine import Engine
from tandem.types import FinishReason, GenerateOutput, SamplingParams, TokenDelta


def check_text(sampling: SamplingParams, tokenizer, name: str = "sampling_params") -> None:
    """Refuse (ValueError naming the field) the text-level fields a server without a tokenizer cannot honour."""
    if tokenizer is None and sampling.stop:
        raise ValueError(f"{name}.stop: stop strings need a tokenizer, and this model directory has none (send "
                         "stop_token_ids)")


def decode(tokenizer, ids: list[int], sampling: SamplingParams) -> str:
    """`ids` as text, with the request's special-token handling; "" without a tokenizer."""
    if tokenizer is None or not ids:
        return ""
    return tokenizer.decode(ids, skip_special_tokens=sampling.skip_special_tokens,
                            spaces_between_special_tokens=sampling.spaces_between_special_tokens)


def token_texts(tokenizer, ids: list[int]) -> list[str | None]:
    """Each token's own text (SGLang's `return_text_in_logprobs`); None for each without a tokenizer."""
    if tokenizer is None:
        return [None] * len(ids)
    return tokenizer.batch_decode([[t] for t in ids])


class OutputText:
    """One request's output text, decoded incrementally as its tokens arrive, and its stop strings.

    `feed(ids)` decodes the next output tokens one at a time; once the text contains a stop string it returns how
    many of `ids` to keep (the token completing the match included) and feeds nothing more. `text` is the output
    decoded so far, held back while its last token ends in an incomplete UTF-8 character."""

    def __init__(self, tokenizer, sampling: SamplingParams):
        self.tokenizer, self.sampling = tokenizer, sampling
        self.ids: list[int] = []
        self.text = ""
        self.matched: str | None = None
        self._prefix = self._read = 0  # decode from `_prefix` (context for the tokenizer); new text from `_read`
        self._scanned = 0  # the text before this holds no stop string
        self._longest = max(map(len, sampling.stop), default=0)

    def feed(self, ids: list[int]) -> int | None:
        for i, token in enumerate(ids):
            if self.matched is not None:
                return None
            self.ids.append(token)
            if self.tokenizer is None:
                continue
            self.text += self._step()
            if self.sampling.stop and self._match():
                return i + 1
        return None

    def _step(self) -> str:
        before = decode(self.tokenizer, self.ids[self._prefix:self._read], self.sampling)
        after = decode(self.tokenizer, self.ids[self._prefix:], self.sampling)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # (an incomplete character: wait for the bytes that complete it)
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before):]

    def _match(self) -> bool:
        start = max(0, self._scanned - self._longest + 1)
        found = [(pos, s) for s in self.sampling.stop if (pos := self.text.find(s, start)) != -1]
        self._scanned = len(self.text)
        if found:
            self.matched = min(found)[1]
        return bool(found)


def final_text(tokenizer, out: GenerateOutput, sampling: SamplingParams) -> str:
    """The text a finished request returns (see the module's contract for trimming)."""
    reason, ids = out.finish_reason, out.output_ids
    if reason.type == "stop" and isinstance(reason.matched, int) and not sampling.no_stop_trim and ids:
        ids = ids[:-1]
    text = decode(tokenizer, ids, sampling)
    if reason.type == "stop" and isinstance(reason.matched, str) and (pos := text.find(reason.matched)) != -1:
        text = text[:pos] if not sampling.no_stop_trim else text[:pos + len(reason.matched)]
    return text


def cut(out: GenerateOutput, keep: int, matched: str) -> GenerateOutput:
    """`out` ended after its first `keep` output tokens by stop string `matched`."""
    top = out.output_top_logprobs
    routed = out.routed_experts
    if routed is not None:  # rows of every token but the last
        routed = routed[:out.prompt_tokens + keep - 1]
    return dataclasses.replace(
        out, output_ids=out.output_ids[:keep], output_logprobs=out.output_logprobs[:keep],
        weight_versions=out.weight_versions[:keep], output_top_logprobs=top[:keep] if top is not None else None,
        routed_experts=routed, finish_reason=FinishReason("stop", matched=matched))


async def generate_stream(engine: Engine, input_ids: list[int], sampling: SamplingParams, rid: str,
                          submit: Awaitable[GenerateOutput] | None = None, tokenizer=None,
                          return_routed_experts: bool = False) -> AsyncIterator[GenerateOutput]:
    """Run one request, yielding its progress: a `GenerateOutput` with `finish_reason` None after each step that
    sampled tokens for it (cumulative: every output token so far, and `text` decoded so far; its lists are the
    stream's own, read them before the next item), then its final output (`finish_reason` set, `text` final). The
    request is submitted here with `engine.generate`, or as the awaitable `submit` (another path to the engine, such
    as a decode server's; it must submit under `rid`). Closing the iterator early aborts the request."""
    loop = asyncio.get_running_loop()
    deltas: asyncio.Queue[TokenDelta] = asyncio.Queue()
    engine.watch(rid, lambda delta: loop.call_soon_threadsafe(deltas.put_nowait, delta))
    task = asyncio.ensure_future(submit if submit is not None else engine.generate(
        input_ids, sampling, rid, return_routed_experts=return_routed_experts))
    progress = _Progress(rid, len(input_ids), OutputText(tokenizer, sampling))
    try:
        while not task.done() and progress.keep is None:
            getter = asyncio.ensure_future(deltas.get())
            await asyncio.wait([task, getter], return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                break
            if progress.add(getter.result()):
                yield progress.partial()
        if progress.keep is not None:
            engine.abort(rid)  # (its output arrives all the same)
        out = await task
    finally:
        engine.unwatch(rid)
        if not task.done():
            task.cancel()
            await asyncio.wait([task])  # (lets `engine.generate` send its abort)
    yield progress.finish(out, tokenizer, sampling)


async def generate(engine: Engine, input_ids: list[int], sampling: SamplingParams, rid: str,
                   submit: Awaitable[GenerateOutput] | None = None, tokenizer=None,
                   return_routed_experts: bool = False) -> GenerateOutput:
    """`generate_stream`'s final output. A request without stop strings is not watched: submitted and decoded."""
    if not sampling.stop or tokenizer is None:
        out = await (submit if submit is not None else engine.generate(
            input_ids, sampling, rid, return_routed_experts=return_routed_experts))
        out.text = final_text(tokenizer, out, sampling)
        return out
    async for out in generate_stream(engine, input_ids, sampling, rid, submit, tokenizer, return_routed_experts):
        if out.finish_reason is not None:
            return out
    raise AssertionError("generate_stream ends with the final output")


@dataclasses.dataclass
class _Progress:
    """What a streamed request has sampled so far, from its watched deltas."""

    rid: str
    prompt_tokens: int
    text: OutputText
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    top: list | None = None
    keep: int | None = None  # set when a stop string matched: the output tokens to keep

    def add(self, delta: TokenDelta) -> bool:
        """Take a delta (in order); whether it adds tokens to send (none once a stop string matched)."""
        if self.keep is not None or delta.start != len(self.text.ids):
            return False
        n = self.text.feed(delta.output_ids)
        take = len(delta.output_ids) if n is None else n
        self.logprobs += delta.output_logprobs[:take]
        self.versions += delta.weight_versions[:take]
        if delta.output_top_logprobs is not None:
            self.top = (self.top or []) + delta.output_top_logprobs[:take]
        if n is not None:
            self.keep = len(self.logprobs)
            return False
        return True

    def partial(self) -> GenerateOutput:
        return GenerateOutput(self.rid, self.text.ids, self.logprobs, self.versions, None, self.prompt_tokens, 0,
                              output_top_logprobs=self.top, text=self.text.text,
                              weight_version=self.versions[-1] if self.versions else 0)

    def finish(self, out: GenerateOutput, tokenizer, sampling: SamplingParams) -> GenerateOutput:
        """The final output: cut at the stop string matched while watching, or at one in the tokens that arrived
        only with the output."""
        if self.keep is None and self.text.matched is None:
            n = self.text.feed(out.output_ids[len(self.text.ids):])
            if n is not None:
                self.keep = len(self.text.ids)
        if self.keep is not None:
            out = cut(out, self.keep, self.text.matched)
        out.text = final_text(tokenizer, out, sampling)
        return out

