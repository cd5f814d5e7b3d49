"""The OpenAI-compatible replies (`tandem.server.openai_api`): choices, usage, logprobs, and the chunks of a stream.

Every choice carries, beside OpenAI's fields, the exact tokens: `prompt_token_ids` and `token_ids` (SGLang's
`return_token_ids` names, sglang#30917, which vLLM's also uses) and `meta_info`, the object `/generate` returns
(`output_token_logprobs`, `output_token_weight_versions`, `weight_version`, `cached_tokens`, `finish_reason`...).
In a stream `token_ids` ride with the chunks that carry their text, `prompt_token_ids` with a choice's first chunk
and `meta_info` with its last.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from tandem.server import chat, text
from tandem.types import GenerateOutput, SamplingParams


@dataclass(slots=True)
class Choice:
    """A choice's prompt and its output: in progress (`out.finish_reason` None, `out.text` decoded so far) or
    finished (`out.text` final: stop string and stop token trimmed)."""

    index: int
    prompt_ids: list[int]
    out: GenerateOutput
    sampling: SamplingParams

    @property
    def finished(self) -> bool:
        return self.out.finish_reason is not None

    @property
    def finish(self) -> str:
        """OpenAI's finish reason ("length" for a request cut by length; an abort never reaches a reply)."""
        return "length" if self.out.finish_reason.type == "length" else "stop"

    def meta_info(self, tokenizer) -> dict:
        out = self.out
        tops = [text.token_texts(tokenizer, [t for _, t in top]) for top in out.output_top_logprobs] \
            if out.output_top_logprobs is not None and tokenizer is not None else None
        return out.meta_info(True, text.token_texts(tokenizer, out.output_ids) if tokenizer else None, tops)


def head(kind: str, model_id: str) -> dict:
    return {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
            "created": int(time.time()), "model": model_id}


def usage(choices: list[Choice]) -> dict:
    prompt = sum(len(p) for p in {tuple(c.prompt_ids) for c in choices})
    completion = sum(len(c.out.output_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _texts(tokenizer, ids: list[int]) -> list[str]:
    return tokenizer.batch_decode([[t] for t in ids]) if tokenizer else [f"token_id:{t}" for t in ids]


def chat_logprobs(out: GenerateOutput, start: int, tokenizer) -> dict:
    """OpenAI's chat `logprobs` of output tokens `start:`."""
    ids, tops = out.output_ids[start:], (out.output_top_logprobs or [])[start:]
    content = []
    for k, (s, lp) in enumerate(zip(_texts(tokenizer, ids), out.output_logprobs[start:], strict=True)):
        top = [{"token": ts, "logprob": tlp, "bytes": list(ts.encode())}
               for ts, (tlp, _) in zip(_texts(tokenizer, [t for _, t in tops[k]]), tops[k], strict=True)] \
            if k < len(tops) else []
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": top})
    return {"content": content}


def completion_logprobs(out: GenerateOutput, start: int, tokenizer, offset: int = 0) -> dict:
    """The legacy completions `logprobs` of output tokens `start:` (`offset`: the text before them)."""
    tokens = _texts(tokenizer, out.output_ids[start:])
    offsets = [offset + sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    tops = None
    if out.output_top_logprobs is not None:
        tops = [{s: lp for s, (lp, _) in zip(_texts(tokenizer, [t for _, t in top]), top, strict=True)}
                for top in out.output_top_logprobs[start:]]
    return {"tokens": tokens, "token_logprobs": out.output_logprobs[start:], "top_logprobs": tops,
            "text_offset": offsets}


def chat_message(c: Choice, tools: bool) -> tuple[dict, str]:
    """The assistant message of a finished choice and its finish reason (`tools`: parse `<tool_call>` JSON)."""
    content, calls = chat.parse_tool_calls(c.out.text) if tools else (c.out.text, [])
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, "tool_calls" if calls and c.finish == "stop" else c.finish


def exact(c: Choice, tokenizer) -> dict:
    return {"prompt_token_ids": c.prompt_ids, "token_ids": c.out.output_ids, "meta_info": c.meta_info(tokenizer)}


def chat_choice(c: Choice, tools: bool, logprobs: bool, tokenizer) -> dict:
    message, finish = chat_message(c, tools)
    return {"index": c.index, "message": message, "finish_reason": finish,
            "logprobs": chat_logprobs(c.out, 0, tokenizer) if logprobs else None, **exact(c, tokenizer)}


def completion_choice(c: Choice, logprobs: bool, tokenizer) -> dict:
    return {"index": c.index, "text": c.out.text, "finish_reason": c.finish,
            "logprobs": completion_logprobs(c.out, 0, tokenizer) if logprobs else None, **exact(c, tokenizer)}


class Stream:
    """The chunks of one streamed reply, built from its choices' progress (`chunks(choice)`, any order across
    choices, in order within one). Text is held back while it could still end in a stop string's beginning (and
    whole, until the end, when tool calls are parsed from it: `hold_all`)."""

    def __init__(self, kind: str, model_id: str, tokenizer, logprobs: bool, hold_all: bool = False):
        self.head = head(kind, model_id)
        self.chat = kind == "chat.completion.chunk"
        self.tokenizer, self.logprobs, self.hold_all = tokenizer, logprobs, hold_all
        self.sent: dict[int, tuple[int, str]] = {}  # choice index -> (ids sent, text sent)

    def _chunk(self, choice: dict) -> dict:
        return self.head | {"choices": [choice]}

    def chunks(self, c: Choice) -> list[dict]:
        out, chunks = c.out, []
        if c.index not in self.sent:
            self.sent[c.index] = (0, "")
            if self.chat:
                chunks.append(self._chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None,
                                           "prompt_token_ids": c.prompt_ids}))
        n_sent, text_sent = self.sent[c.index]
        held = max(map(len, c.sampling.stop), default=1) - 1
        shown = out.text if c.finished else "" if self.hold_all else out.text[:len(out.text) - held]
        new_text = shown[len(text_sent):] if shown.startswith(text_sent) else ""
        new_ids = out.output_ids[n_sent:]
        message = finish = None
        if c.finished and self.chat:
            message, finish = chat_message(c, self.hold_all)
            new_text = (message["content"] or "") if self.hold_all else new_text
        if new_text or new_ids:
            piece = {"index": c.index, "finish_reason": None, "token_ids": new_ids}
            if self.chat:
                piece |= {"delta": {"content": new_text},
                          "logprobs": chat_logprobs(out, n_sent, self.tokenizer) if self.logprobs else None}
            else:
                piece |= {"text": new_text, "logprobs": completion_logprobs(
                    out, n_sent, self.tokenizer, len(text_sent)) if self.logprobs else None}
                piece |= {} if n_sent else {"prompt_token_ids": c.prompt_ids}
            chunks.append(self._chunk(piece))
            self.sent[c.index] = (len(out.output_ids), text_sent + new_text)
        if c.finished:
            last = {"index": c.index, "finish_reason": finish or c.finish, "meta_info": c.meta_info(self.tokenizer)}
            if message is not None and message.get("tool_calls"):
                chunks.append(self._chunk({"index": c.index, "finish_reason": None, "delta": {"tool_calls": [
                    {"index": k, **call} for k, call in enumerate(message["tool_calls"])]}}))
            chunks.append(self._chunk(last | ({"delta": {}} if self.chat else {"text": ""})))
        return chunks

    def usage_chunk(self, choices: list[Choice], extra: dict | None = None) -> dict:
        return self.head | {"choices": [], "usage": usage(choices), **(extra or {})}
