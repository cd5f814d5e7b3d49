"""A model directory's tokenizer and chat template, loaded with `transformers` (never parsed by hand), and a small
tokenizer trained on text shipped here, for tests, examples and the CPU demo (no tokenizer can be downloaded).

The engine stays token-in token-out; a tokenizer only adds text at the edges (the HTTP server's `text` fields,
stop strings, chat endpoints). `load_tokenizer` returns a `transformers` tokenizer, so `encode`, `decode` and
`apply_chat_template` are that library's.
"""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Qwen's control tokens (special: dropped by skip_special_tokens) and markup tokens (plain added tokens, kept).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKUP_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# ChatML as Qwen3 renders it: tools listed in the system turn, tool calls as <tool_call> JSON, tool results as a
# user turn, and the thinking of assistant turns before the last user message dropped (so the template is not
# append-only: a later render of an earlier turn differs from what was sampled).
CHAT_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- if tools or messages[0].role == 'system' -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}
{%- if tools %}

# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call a tool as <tool_call>{"name": NAME, "arguments": {...}}</tool_call>
{%- endif %}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}
{%- elif m.role == 'assistant' -%}
{%- set content = m.content or '' -%}
{%- if loop.index0 < ns.last_user and '</think>' in content -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
<|im_start|>assistant
{{ content }}
{%- for call in m.tool_calls or [] -%}
{%- set f = call.function if call.function is defined else call -%}
{%- set args = f.arguments if f.arguments is string else f.arguments | tojson -%}
<tool_call>{"name": "{{ f.name }}", "arguments": {{ args }}}</tool_call>
{%- endfor -%}
<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""

# The shipped training text: enough English, digits and chat markup for a byte-level BPE of a few hundred merges.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A tool returns its answer, and the agent reads it.
What is 12 plus 30? The answer is 42. What is 7 times 6? It is 42 as well. 100 minus 58 is 42.
Compute 3 + 4 * 5 = 23. Compute (3 + 4) * 5 = 35. Divide 144 by 12 to get 12. 2 ** 10 = 1024.
The user asks a question; the assistant thinks, calls the calculator, and answers with a number.
Reinforcement learning rewards the right answer. The policy samples tokens; the trainer updates weights.
Hello, world! How are you today? I am fine, thank you. Let me think about it step by step.
The engine keeps pages of keys and values; the scheduler batches requests; the router pairs servers.
{"name": "calculator", "arguments": {"expression": "12 + 30"}} returns {"result": 42}.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 32 64 128 256 512 1000.
"""


def load_tokenizer(model: str | Path, vocab_size: int | None = None):
    """The tokenizer saved in directory `model` (its `tokenizer.json` / `tokenizer_config.json`, chat template
    included), or None when `model` is a preset name or a directory without one. ValueError naming the directory
    when the files do not load, or when the tokenizer has ids the model's `vocab_size` cannot embed."""
    path = Path(model)
    if not path.is_dir() or not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # the library's errors name no common type
        raise ValueError(f"tokenizer: cannot load the tokenizer in {str(path)!r}: {e}") from None
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer: the tokenizer in {str(path)!r} has {len(tokenizer)} tokens, more than the "
                         f"model's vocab_size {vocab_size}")
    return tokenizer


def train_tokenizer(directory: str | Path, vocab_size: int = 400, text: str = CORPUS):
    """Train a byte-level BPE of at most `vocab_size` tokens on `text`, with Qwen's special and markup tokens and
    `CHAT_TEMPLATE`, and save it in `directory` as `transformers` does (beside a model's config and weights).
    Returns the loaded tokenizer. Deterministic: the same text and size give the same ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(MARKUP_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(text.splitlines(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATE)
    tokenizer.add_tokens(list(MARKUP_TOKENS))
    Path(directory).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    return load_tokenizer(directory)
