"""Chat messages as token ids and back: the model's chat template (rendered by `transformers`), the exact rendering
of messages appended to a conversation (`render_suffix`, what session-scoped chat tokenizes), tool calls parsed
from `<tool_call>` JSON, and messages normalised for comparison.

Token-exactness of an appended suffix: the history a session keeps ends with the end-of-turn token (ChatML's
`<|im_end|>`, the tokenizer's `eos_token`), sampled or closed by the server; the suffix is the text the template
renders after that token. An end-of-turn token is an added token, which `tokenizers` splits the text at before
BPE, so encoding the suffix alone gives exactly the ids that encoding the whole conversation would give it there.
What the template renders of the earlier turns (e.g. Qwen3's dropping of earlier thinking) never enters: the
suffix is measured against a fixed two-message conversation, not the real one.
"""

from __future__ import annotations

import json
import re
import uuid

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# a conversation whose rendering ends where an assistant turn ends: the suffix is measured after it
_ANCHOR = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


class NotAppendable(ValueError):
    """The template renders the appended messages differently after other turns: re-render the conversation."""


def render(tokenizer, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None,
           generation_prompt: bool = True) -> str:
    """The template's text of `messages` (with `tools`), ready for the assistant's turn."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=generation_prompt, **(template_kwargs or {}))
    except Exception as e:  # jinja's errors (a message the template cannot render) name no common type
        raise ValueError(f"messages: the chat template cannot render them ({type(e).__name__}: {e})") from None


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def render_suffix(tokenizer, appended: list[dict], tools: list[dict] | None, template_kwargs: dict | None) -> str:
    """The text that follows an assistant turn's end-of-turn token when `appended` come after it, through the
    generation prompt of the next assistant turn. NotAppendable when the template does not render it as a suffix."""
    eos = tokenizer.eos_token
    before = render(tokenizer, _ANCHOR, tools, template_kwargs, generation_prompt=False)
    after = render(tokenizer, _ANCHOR + appended, tools, template_kwargs)
    end = before.rfind(eos) if eos else -1
    if end < 0 or not after.startswith(before):
        raise NotAppendable("the chat template does not render appended messages after an assistant turn's "
                            f"end-of-turn token {eos!r}")
    return before[end + len(eos):] + after[len(before):]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split an assistant's text into its content and OpenAI `tool_calls` (`<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>` blocks whose JSON parses; a malformed block stays in the content)."""
    calls, kept, last = [], [], 0
    for m in TOOL_CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
            name, args = call["name"], call.get("arguments", {})
            assert isinstance(name, str) and isinstance(args, dict)
        except (ValueError, KeyError, TypeError, AssertionError):
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args)}})
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


def normalize(message: dict) -> dict:
    """What of a message the template renders, in one form: content as text (text parts joined), tool calls with
    their arguments parsed (ids dropped), empty fields dropped. Two messages render alike when their normal forms
    are equal; the template is given this form."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError("messages: each must be an object with a string role")
    # (a client may echo a returned message back with empty fields: `refusal: null`, `annotations: []`)
    out = {k: v for k, v in message.items() if k not in ("content", "tool_calls", "tool_call_id")
           and v not in (None, [], {})}
    content = message.get("content")
    if isinstance(content, list):  # OpenAI's content parts
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise ValueError("messages: only text content parts are supported")
        content = "".join(p.get("text", "") for p in content)
    out["content"] = content or ""
    calls = []
    for call in message.get("tool_calls") or []:
        f = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ValueError("messages: a tool call must be an object with a function name")
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise ValueError(f"messages: tool call {f['name']!r} has arguments that are not JSON") from None
        calls.append({"type": "function", "function": {"name": f["name"], "arguments": args}})
    if calls:
        out["tool_calls"] = calls
    return out
