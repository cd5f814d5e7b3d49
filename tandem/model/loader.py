"""Building a model: from a preset or `config.json`, with random weights or from `*.safetensors`
(single file, or sharded with `model.safetensors.index.json`). `load_weights` is also the path of
in-place weight updates, so it validates names and shapes before touching any parameter."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.config import ModelConfig, resolve_model
from tandem.distributed.parallel import SINGLE, TPGroup, layouts, shard_into, zero_padding
from tandem.model.qwen3 import Qwen3ForCausalLM
from tandem.transport.weights import FlatTensors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    views of the parameters: no per-tensor view is made on either side."""

    def __init__(self, model: Qwen3ForCausalLM):
        self.model, self.params, self.layout = model, dict(model.named_parameters()), layouts(model)
        self.flat: dict[str, torch.Tensor] = {}  # name -> a flat view of the parameter, made at its first flat load

    def _check(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Raise ValueError if the tensor does not fit; whether it is copied (a tied head is the embedding)."""
        if name == "lm_head.weight" and self.model.config.tie_word_embeddings:
            return False
        if name not in self.params:
            raise ValueError(f"weights: unknown parameter {name!r}")
        if shape != self.layout[name][1]:
            raise ValueError(f"weights: {name} has shape {shape}, the model expects {self.layout[name][1]}")
        if not dtype.is_floating_point:
            raise ValueError(f"weights: {name} has dtype {dtype}, expected a floating-point tensor")
        return True

    def check(self, named: dict[str, torch.Tensor]) -> None:
        """Raise ValueError naming the first tensor that does not fit; mutates nothing."""
        for name, tensor in named.items():
            self._check(name, tuple(tensor.shape), tensor.dtype)

    @torch.no_grad()
    def load(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
             strict: bool = False) -> list[str]:
        """All tensors are checked before any is copied, so a bad update leaves the model untouched. `strict`:
        every parameter must be given. Returns the names given, sorted."""
        if isinstance(named, FlatTensors) and self.model.tp.size == 1:
            given, dests, sources = self._plan_flat(named)
        else:
            named = named if isinstance(named, Mapping) else dict(named)
            self.check(named)
            given, loaded = list(named), [name for name in named if name in self.params]
            pairs = [shard_into(self.params[name], named[name], self.layout[name][0], self.model.tp)
                     for name in loaded]
            dests, sources = [d for d, _ in pairs], [s for _, s in pairs]
        if strict and (missing := sorted(set(self.params) - set(given))):
            raise ValueError(f"weights: missing parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        torch._foreach_copy_(dests, sources)  # one call for every copy: an update is a few hundred tensors
        # sources made on another stream (a transport's buckets) may be freed and reused there once the caller
        # drops them: not before this stream's copy has read them (once per storage: a bucket holds many views)
        storages = {t.untyped_storage().data_ptr(): t for t in sources if t.is_cuda}
        for t in storages.values():
            t.record_stream(torch.cuda.current_stream(t.device))
        return sorted(given)

    def _plan_flat(self, named: FlatTensors) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        """(names given, flat parameter views, pieces of the buffers to copy into them), every tensor checked."""
        given, dests, sources = [], [], []
        for names, shapes, flat_N in named.buckets:
            pieces = torch.split(flat_N, [math.prod(shape) for shape in shapes])
            for name, shape, piece in zip(names, shapes, pieces, strict=True):
                if self._check(name, tuple(shape), flat_N.dtype):
                    p, flat = self.params[name], self.flat.get(name)
                    if flat is None or flat.data_ptr() != p.data_ptr():  # (re)made if the parameter was re-pointed
                        flat = self.flat[name] = p.view(-1) if p.is_contiguous() else None
                    dests.append(p if flat is None else flat)
                    sources.append(piece.view(shape) if flat is None else piece)
            given += names
        return given, dests, sources


def load_weights(model: Qwen3ForCausalLM, named: Iterable[tuple[str, torch.Tensor]], strict: bool = False):
    """`WeightLoader(model).load(named, strict)`, for a one-off load."""
    return WeightLoader(model).load(named, strict)


def build_model(model: str | ModelConfig, device: str | torch.device = "cpu", dtype: str | None = None,
                seed: int = 0, tp: TPGroup = SINGLE) -> Qwen3ForCausalLM:
    """A model from a preset name, a checkpoint directory or a config. Random weights (seeded) unless the
    directory holds safetensors. `dtype` overrides the config's (the CPU default is float32)."""
    if isinstance(model, ModelConfig):
        config, weights_dir = model, None
    else:
        config, weights_dir = resolve_model(model)
    torch_dtype = DTYPES[dtype or config.dtype]
    with torch.device("meta"):
        net = Qwen3ForCausalLM(config, tp)
    net = net.to_empty(device=device).to(torch_dtype)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight  # to_empty unties; tie again
    zero_padding(net)  # (rows that no load writes: a padded vocabulary's)
    if weights_dir is None:
        net.init_random(seed)
    else:
        load_weights(net, iter_safetensors(weights_dir), strict=True)
    return net.eval()
