"""Checkpoints users can take away: a run's policy as a Hugging Face checkpoint that `transformers`, serving engines
and `tandem serve` load.

What a run directory holds (`tandem run`): `config.json` (the run's `RunConfig`), `metrics.jsonl` (one record per
step), `checkpoint.pt` (the crash-resume checkpoint, replaced atomically every `checkpoint_every` steps and at the
end: the trainer's float32 master weights, its optimizer state and weight version, the rollout manager's state and
the RNGs; a `checkpoint.pt.tmp` is a save that never finished) and, with `trainer.export_every`, `exports/step_N/`.
There is one checkpoint, the newest; `export_run` exports its weights.

An export directory holds what `save_pretrained` writes: the weights as safetensors (`model.safetensors`, or shards
`model-0000i-of-0000n.safetensors` with `model.safetensors.index.json` beyond `max_shard_bytes`), `config.json`
(Qwen3ForCausalLM or Qwen3MoeForCausalLM), `generation_config.json` (sampling at the run's temperature and top-p,
the distribution the policy was trained for) and, when the run's model directory has one, the tokenizer (saved by
`transformers`). A mixture-of-experts model's experts, stacked in tandem, are written one tensor per expert, the form
Hugging Face checkpoints store them in. A tied head is written once, as the embedding.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from tandem.config import Dtype, ModelConfig, RunConfig, _build, resolve_model
from tandem.model.loader import DTYPES
from tandem.model.qwen3 import Qwen3ForCausalLM
from tandem.tokenizer import load_tokenizer

CHECKPOINT = "checkpoint.pt"  # (the names `tandem.run.loop` writes)
RUN_CONFIG = "config.json"
EXPORTS = "exports"
MAX_SHARD_BYTES = 5 * 10**9  # (Hugging Face's 5GB)
_STACKED = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)")


@dataclasses.dataclass(frozen=True, slots=True)
class Exported:
    """What an export wrote: `files` (names in `out_dir`), the weight `version` (trainer steps) and the `dtype`;
    `no_tokenizer`: None, or why no tokenizer came along."""

    out_dir: Path
    version: int
    dtype: str
    files: tuple[str, ...]
    no_tokenizer: str | None


def export_run(run_dir: str | Path, out_dir: str | Path, dtype: Dtype | None = None,
               max_shard_bytes: int = MAX_SHARD_BYTES) -> Exported:
    """Export the policy in `run_dir`'s `checkpoint.pt` to `out_dir` (which must not exist or be empty) in `dtype`
    (None: the dtype it was trained in, the run's `trainer.param_dtype`). ValueError naming what is missing or
    wrong: no run directory, no `config.json` or `checkpoint.pt`, an unreadable checkpoint, a tensor missing, of
    the wrong shape or not finite."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not run_dir.is_dir():
        raise ValueError(f"RUN_DIR {str(run_dir)!r} is not a directory")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"OUT_DIR {str(out_dir)!r} exists and is not an empty directory")
    cfg = _run_config(run_dir)
    state = _read_checkpoint(run_dir)
    return write_hf_checkpoint(state["model"], cfg, out_dir, dtype or cfg.trainer.param_dtype, state["version"],
                               max_shard_bytes)


def export_trainer(cfg: RunConfig, trainer, max_shard_bytes: int = MAX_SHARD_BYTES) -> Exported:
    """The run's own export (`trainer.export_every`): the trainer's current weights to
    `out_dir/exports/step_{version:06d}` in the dtype it trains in, replacing an export of that step (a step trained
    again after a resume). Call between steps (the weights are read live)."""
    out = Path(cfg.out_dir) / EXPORTS / f"step_{trainer.version:06d}"
    return write_hf_checkpoint(trainer.state_dict()["model"], cfg, out, cfg.trainer.param_dtype, trainer.version,
                               max_shard_bytes)


def write_hf_checkpoint(state: Mapping[str, torch.Tensor], cfg: RunConfig, out_dir: Path, dtype: Dtype,
                        version: int, max_shard_bytes: int = MAX_SHARD_BYTES) -> Exported:
    """Write `state` (a tandem model's state dict, as the trainer saves it) for the run `cfg` as a Hugging Face
    checkpoint in `out_dir`, replacing what is there. Everything is checked before anything is written, and the
    directory appears whole or not at all (it is written beside and renamed into place)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    config = _model_config(cfg.model)
    tensors = hf_tensors(state, config)
    tokenizer = load_tokenizer(cfg.model, config.vocab_size)
    partial = out_dir.parent / f".{out_dir.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        _write_weights(tensors, DTYPES[dtype], partial, max_shard_bytes)
        (partial / "config.json").write_text(json.dumps(_hf_config(cfg.model, config, dtype), indent=2) + "\n")
        _generation_config(cfg, config).save_pretrained(partial)
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        partial.rename(out_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    no_tokenizer = None if tokenizer is not None else (
        f"the run's model {cfg.model!r} is a preset" if not Path(cfg.model).is_dir()
        else f"the run's model directory {cfg.model!r} has no tokenizer files")
    return Exported(out_dir, version, dtype, tuple(sorted(p.name for p in out_dir.iterdir())), no_tokenizer)


def hf_tensors(state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face's names and tensors (views of `state`'s) for a tandem state dict of a model of `config`: every
    parameter present with its shape, floating point and finite, nothing unknown (else ValueError naming it); the
    stacked experts as one tensor per expert; a tied head omitted."""
    with torch.device("meta"):
        params = {name: tuple(p.shape) for name, p in Qwen3ForCausalLM(config).named_parameters()}
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()  # (the embedding's twin)
    if missing := [name for name in params if name not in state]:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of the model: "
                         f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unknown := sorted(set(state) - set(params) - ignored):
        raise ValueError(f"the checkpoint holds tensors the model does not have: {unknown[:5]}")
    out: dict[str, torch.Tensor] = {}
    for name, shape in params.items():
        tensor = state[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, the model expects {shape}")
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{name} has dtype {tensor.dtype}, expected floating point")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{name} holds NaN or infinite values")
        out.update(_hf_named(name, tensor))
    return out


def _hf_named(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) as Hugging Face checkpoints store it: stacked experts [E, 2I, H] / [E, H, I] become
    `{prefix}.{j}.gate_proj.weight` and `up_proj` [I, H] each, `down_proj` [H, I]."""
    if (m := _STACKED.fullmatch(name)) is None:
        yield name, tensor
        return
    prefix, part = m[1], m[2]
    for j, expert in enumerate(tensor):
        if part == "down_proj":
            yield f"{prefix}.{j}.down_proj.weight", expert
        else:
            gate, up = expert.chunk(2)
            yield f"{prefix}.{j}.gate_proj.weight", gate
            yield f"{prefix}.{j}.up_proj.weight", up


def _write_weights(tensors: dict[str, torch.Tensor], dtype: torch.dtype, out: Path, max_shard_bytes: int) -> None:
    """Shards of at most `max_shard_bytes` (a larger tensor alone in one), in the model's order, one in memory at a
    time; an index when there are several."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, names in zip(files, shards, strict=True):
        # copies: safetensors refuses tensors that share storage (an expert's gate and up rows do)
        save_file({n: tensors[n].detach().to("cpu", dtype, copy=True).contiguous() for n in names}, out / file,
                  metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() for t in tensors.values()) * itemsize},
                 "weight_map": {n: file for file, names in zip(files, shards, strict=True) for n in names}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _hf_config(model: str, config: ModelConfig, dtype: str) -> dict:
    """The run's model's `config.json` (its extra keys kept, when the model was a directory) with tandem's fields
    and the export's dtype (under both names transformers has used for it)."""
    original = Path(model) / "config.json"
    d = json.loads(original.read_text()) if original.is_file() else {}
    eos = d.get("eos_token_id")  # (a list in some configs: ModelConfig keeps only the first)
    d.update(config.to_hf_dict(), torch_dtype=dtype, dtype=dtype)
    if eos is not None:
        d["eos_token_id"] = eos
    return d


def _generation_config(cfg: RunConfig, config: ModelConfig):
    """The model directory's generation config, else one with the model's end-of-sequence id, sampling at the run's
    temperature and top-p: the policy the trainer optimised is the one sampled that way."""
    from transformers import GenerationConfig

    if (Path(cfg.model) / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(cfg.model)
    else:
        generation = GenerationConfig(eos_token_id=config.eos_token_id)
    generation.do_sample, generation.temperature, generation.top_p = True, cfg.rollout.temperature, cfg.rollout.top_p
    return generation


def _model_config(model: str) -> ModelConfig:
    try:
        return resolve_model(model)[0]
    except ValueError as e:
        raise ValueError(f"the run's model is no longer readable ({e})") from None


def _run_config(run_dir: Path) -> RunConfig:
    path = run_dir / RUN_CONFIG
    if not path.is_file():
        raise ValueError(f"{str(run_dir)!r} has no {RUN_CONFIG} (the run's config, which `tandem run` writes "
                         "as it starts): it names the model whose weights the checkpoint holds")
    try:
        return _build(RunConfig, json.loads(path.read_text()), "run")
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def _read_checkpoint(run_dir: Path) -> dict:
    """The trainer's part of the run's checkpoint ({"model": state dict, "version": int}), memory-mapped (its
    optimizer state is never read)."""
    path = run_dir / CHECKPOINT
    if not path.is_file():
        partial = " (only an unfinished save, checkpoint.pt.tmp)" if (run_dir / f"{CHECKPOINT}.tmp").exists() else ""
        raise ValueError(f"{str(run_dir)!r} has no {CHECKPOINT}{partial}: a run writes it every "
                         "checkpoint_every steps and when it ends")
    try:
        state = torch.load(path, weights_only=True, mmap=True)
    except Exception as e:  # (pickle, zip and torch's own errors: no common type)
        raise ValueError(f"cannot read {path}: {e}") from None
    trainer = state.get("trainer") if isinstance(state, dict) else None
    if not isinstance(trainer, dict) or not isinstance(trainer.get("model"), Mapping) or "version" not in trainer:
        raise ValueError(f"{path} is not a tandem run checkpoint (no trainer model state and version)")
    return trainer


def parse_size(text: str) -> int:
    """'5GB', '500MB', '64KB' or a number of bytes (decimal units, as Hugging Face's `max_shard_size`)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if m is None:
        raise ValueError(f"max shard size {text!r}: expected bytes or a size such as 5GB or 500MB")
    return math.floor(float(m[1]) * {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9,
                                     "GB": 1e9}[m[2]])
