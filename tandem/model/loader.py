"""Building a model: from a preset or `config.json`, with random weights or from `*.safetensors`
(single file, or sharded with `model.safetensors.index.json`). `load_weights` is also the path of
in-place weight updates, so it validates names and shapes before touching any parameter.

A mixture-of-experts model's experts load either stacked, by the model's own names (`...mlp.experts.gate_up_proj`
[E, 2I, H], as a trainer sends them), or one tensor per expert, as Hugging Face checkpoints store them
(`...mlp.experts.{j}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I]).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.config import ModelConfig, resolve_model
from tandem.distributed.parallel import SINGLE, TPGroup, layouts, shard_into, zero_padding
from tandem.model.qwen3 import Qwen3ForCausalLM
from tandem.transport.handover import Handover
from tandem.transport.weights import FlatTensors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PER_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def per_expert_names(prefix: str, num_experts: int) -> list[str]:
    """The names a Hugging Face checkpoint stores the experts of `prefix` (`model.layers.{i}.mlp.experts`) under."""
    return [f"{prefix}.{j}.{part}.weight" for j in range(num_experts) for part in ("gate_proj", "up_proj", "down_proj")]


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from a checkpoint directory, one shard open at a time. An index may name only files
    of the directory itself (no paths out of it)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {path}")
    for file in files:
        if not isinstance(file, str) or (path / file).resolve().parent != path.resolve():
            raise ValueError(f"model: the index names {file!r}, not a file of {path} (shards must lie beside it)")
        if not (path / file).is_file():
            raise ValueError(f"model: {path / file} is named by the index but missing")
        with safe_open(path / file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


class WeightLoader:
    """Copies full (unsharded) tensors into `model` by Hugging Face name (a tensor-parallel rank keeps its slice).
    The model's parameters and their layouts are looked up once, here: an engine loads every weight update inside
    its pause, and re-deriving them was most of a load's host time (BENCHMARKS.md, weight sync). Tensors
    that arrive in flat buffers (`FlatTensors`, from a transport) are copied from pieces of those buffers into flat
    views of the parameters: no per-tensor view is made on either side. Tensors by reference (`Handover`, the
    sender's own memory) are read inside its `reading`: on CUDA the copies wait for the sender's writes and the
    sender's next writes wait for the copies, on the device."""

    def __init__(self, model: Qwen3ForCausalLM):
        self.model, self.params, self.layout = model, dict(model.named_parameters()), layouts(model)
        self.flat: dict[str, torch.Tensor] = {}  # name -> a flat view of the parameter, made at its first flat load
        self.unsplit = all(layout.dim is None or layout.group.size == 1 for layout in self.layout.values())
        self.device = next(iter(self.params.values())).device
        self._last: tuple[list, list[torch.Tensor], list[int]] | None = None  # see `_plan`

    def _check(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Raise ValueError if the tensor does not fit; whether it is copied (a tied head is the embedding)."""
        if name == "lm_head.weight" and self.model.config.tie_word_embeddings:
            return False
        if name not in self.params and _PER_EXPERT.fullmatch(name) is None:
            raise ValueError(f"weights: unknown parameter {name!r}")
        if shape != (expected := self._full_shape(name)):
            raise ValueError(f"weights: {name} has shape {shape}, the model expects {expected}")
        if not dtype.is_floating_point:
            raise ValueError(f"weights: {name} has dtype {dtype}, expected a floating-point tensor")
        return True

    def _full_shape(self, name: str) -> tuple[int, ...]:
        if (m := _PER_EXPERT.fullmatch(name)) is None:
            return self.layout[name].shape
        stacked = f"{m[1]}.{'down_proj' if m[3] == 'down_proj' else 'gate_up_proj'}"
        if stacked not in self.params:
            raise ValueError(f"weights: unknown parameter {name!r} (no experts at {m[1]})")
        E, rows, cols = self.layout[stacked].shape
        if int(m[2]) >= E:
            raise ValueError(f"weights: {name} names expert {m[2]}, the model has {E} (0..{E - 1})")
        return (rows, cols) if m[3] == "down_proj" else (rows // 2, cols)

    def _pair(self, name: str, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the part of this rank's parameter that `full` fills, the part of `full` that fills it); None when it
        belongs to another rank (an expert held elsewhere)."""
        if (m := _PER_EXPERT.fullmatch(name)) is None:
            layout = self.layout[name]
            return shard_into(self.params[name], full, layout.dim, layout.group)
        part = m[3]
        stacked = self.params[f"{m[1]}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"]
        local = int(m[2]) - self.layout[f"{m[1]}.down_proj"].group.rank * stacked.shape[0]
        if not 0 <= local < stacked.shape[0]:
            return None
        if part == "down_proj":
            return stacked[local], full
        rows = stacked.shape[1] // 2
        return stacked[local, :rows] if part == "gate_proj" else stacked[local, rows:], full

    def _missing(self, given: list[str]) -> list[str]:
        """The parameters `given` does not cover: experts count as given stacked, or per expert all of them."""
        given_set, missing = set(given), []
        for name in sorted(set(self.params) - given_set):
            prefix, _, leaf = name.rpartition(".")
            if leaf in ("gate_up_proj", "down_proj") and prefix.endswith(".mlp.experts"):
                parts = ("down_proj",) if leaf == "down_proj" else ("gate_proj", "up_proj")
                names = [n for n in per_expert_names(prefix, self.layout[name].shape[0])
                         if n.rsplit(".", 2)[-2] in parts]
                if any(n in given_set for n in names):  # given per expert: name the first one missing
                    missing += [n for n in names if n not in given_set]
                    continue
            missing.append(name)
        return missing

    def check(self, named: dict[str, torch.Tensor]) -> None:
        """Raise ValueError naming the first tensor that does not fit; mutates nothing."""
        for name, tensor in named.items():
            self._check(name, tuple(tensor.shape), tensor.dtype)

    @torch.no_grad()
    def load(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
             strict: bool = False) -> list[str]:
        """All tensors are checked before any is copied, so a bad update leaves the model untouched. `strict`:
        every parameter must be given. Returns the names given, sorted."""
        if isinstance(named, FlatTensors) and self.unsplit:
            given, dests, sources = self._plan_flat(named)
        else:
            given, dests, sources = self._plan(named if isinstance(named, Mapping) else dict(named))
        if strict and (missing := self._missing(given)):
            raise ValueError(f"weights: missing parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if isinstance(named, Handover):  # the sender's memory: it stays alive, and the events order the reads
            with named.reading(self.device):
                torch._foreach_copy_(dests, sources)
            return sorted(given)
        torch._foreach_copy_(dests, sources)  # one call for every copy: an update is a few hundred tensors
        # sources made on another stream (a transport's buckets) may be freed and reused there once the caller
        # drops them: not before this stream's copy has read them (once per storage: a bucket holds many views)
        storages = {t.untyped_storage().data_ptr(): t for t in sources if t.is_cuda}
        for t in storages.values():
            t.record_stream(torch.cuda.current_stream(t.device))
        return sorted(given)

    def _plan(self, named: Mapping[str, torch.Tensor]) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        """(names given, parameters or their parts, the tensors to copy into them), every tensor checked. The same
        names, shapes and dtypes as the last call (a weight update, every time) reuse its checks and parameters: they
        depend on nothing else (each tensor is copied whole where nothing is split; else it is planned anew)."""
        names, tensors = list(named), list(named.values())
        key = [(name, t.shape, t.dtype) for name, t in zip(names, tensors, strict=True)]
        if self._last is not None and self._last[0] == key:
            _, dests, index = self._last
            return names, dests, [tensors[i] for i in index]
        self.check(named)
        planned = [(i, pair) for i, name in enumerate(names) if (name in self.params or _PER_EXPERT.fullmatch(name))
                   and (pair := self._pair(name, tensors[i])) is not None]
        dests, sources = [d for _, (d, _) in planned], [s for _, (_, s) in planned]
        whole = all(s is tensors[i] for i, (_, s) in planned)
        self._last = (key, dests, [i for i, _ in planned]) if whole and self.unsplit else None
        return names, dests, sources

    def _plan_flat(self, named: FlatTensors) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        """(names given, flat parameter views, pieces of the buffers to copy into them), every tensor checked."""
        given, dests, sources = [], [], []
        for names, shapes, flat_N in named.buckets:
            pieces = torch.split(flat_N, [math.prod(shape) for shape in shapes])
            for name, shape, piece in zip(names, shapes, pieces, strict=True):
                if not self._check(name, tuple(shape), flat_N.dtype):
                    continue
                if name in self.params:
                    p, flat = self.params[name], self.flat.get(name)
                    if flat is None or flat.data_ptr() != p.data_ptr():  # (re)made if the parameter was re-pointed
                        flat = self.flat[name] = p.view(-1) if p.is_contiguous() else None
                    dests.append(p if flat is None else flat)
                    sources.append(piece.view(shape) if flat is None else piece)
                else:  # one expert's tensor
                    dest, source = self._pair(name, piece.view(shape))
                    dests.append(dest)
                    sources.append(source)
            given += names
        return given, dests, sources


def load_weights(model: Qwen3ForCausalLM, named: Iterable[tuple[str, torch.Tensor]], strict: bool = False):
    """`WeightLoader(model).load(named, strict)`, for a one-off load."""
    return WeightLoader(model).load(named, strict)


def build_model(model: str | ModelConfig, device: str | torch.device = "cpu", dtype: str | None = None,
                seed: int = 0, tp: TPGroup = SINGLE, ep: TPGroup = SINGLE) -> Qwen3ForCausalLM:
    """A model from a preset name, a checkpoint directory or a config. Random weights (seeded) unless the
    directory holds safetensors. `dtype` overrides the config's (the CPU default is float32). `tp` and `ep`: see
    `Qwen3ForCausalLM`."""
    if isinstance(model, ModelConfig):
        config, weights_dir = model, None
    else:
        config, weights_dir = resolve_model(model)
    torch_dtype = DTYPES[dtype or config.dtype]
    with torch.device("meta"):
        net = Qwen3ForCausalLM(config, tp, ep)
    net = net.to(torch_dtype).to_empty(device=device)  # (in the dtype from the start: no float32 copy on the device)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight  # to_empty unties; tie again
    zero_padding(net)  # (rows that no load writes: a padded vocabulary's)
    if weights_dir is None:
        net.init_random(seed)
    else:
        load_weights(net, iter_safetensors(weights_dir), strict=True)
    return net.eval()
