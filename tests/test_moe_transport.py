"""Weight updates of a mixture-of-experts model through every transport (in-process, ipc, torch.distributed) into a
running engine: stacked experts as the trainer sends them, or one tensor per expert under Hugging Face's names; the
engine then holds exactly the weights sent and generates what a fresh engine built from them does (greedy tokens
and logprobs). A bad update (a wrong shape, an expert the model lacks, a per-expert name on a dense layer) is refused
with nothing loaded, and the next one goes through."""

import asyncio
import hashlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_engine import GREEDY, prompts
from test_transport import PAIRS

from tandem.config import PRESETS, EngineConfig
from tandem.engine.engine import Engine
from tandem.model.loader import build_model
from tandem.transport.sync import receive_and_load

CONFIG = PRESETS["tiny-moe"]
ENGINE = EngineConfig(page_size=4, num_pages=64)
PROMPTS = prompts(3, CONFIG.vocab_size, seed=7)
TIMEOUT_S = 10.0


def new_model(seed: int = 1):
    """A tiny MoE whose routers are decisive (Hugging Face's init leaves them near uniform)."""
    model = build_model(CONFIG, seed=seed)
    with torch.no_grad():
        for block in model.moe_blocks:
            block.gate.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
    return model


def per_expert(named) -> list[tuple[str, torch.Tensor]]:
    """The pairs with each stacked expert tensor split as a Hugging Face checkpoint stores it (views, no copies)."""
    out = []
    for name, t in named:
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            rows = t.shape[1] // 2
            out += [(f"{prefix}.{j}.{part}.weight", t[j, :rows] if part == "gate_proj" else t[j, rows:])
                    for j in range(t.shape[0]) for part in ("gate_proj", "up_proj")]
        elif leaf == "down_proj" and prefix.endswith(".experts"):
            out += [(f"{prefix}.{j}.down_proj.weight", t[j]) for j in range(t.shape[0])]
        else:
            out.append((name, t))
    return out


def digest(model) -> dict[str, str]:
    return {name: hashlib.sha256(p.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, p in model.named_parameters()}


def generate(engine: Engine) -> list[tuple[list[int], list[float]]]:
    async def go():
        return await asyncio.gather(*[engine.generate(p, GREEDY) for p in PROMPTS])

    return [(out.output_ids, out.output_logprobs) for out in asyncio.run(go())]


def assert_same(got, fresh):
    for (ids, logprobs), (fresh_ids, fresh_logprobs) in zip(got, fresh, strict=True):
        assert ids == fresh_ids
        assert logprobs == pytest.approx(fresh_logprobs, abs=1e-6)


@pytest.fixture(scope="module")
def fresh() -> list[tuple[list[int], list[float]]]:
    """What an engine built from the new weights generates; the old weights generate something else."""
    with Engine(new_model(), ENGINE) as engine:
        outputs = generate(engine)
    with Engine(build_model(CONFIG, seed=0), ENGINE) as old:
        assert generate(old) != outputs
    return outputs


def sync(sender, receiver, engine: Engine, named, version: int):
    """One transfer: `send` in a thread, the engine's end (`receive_and_load`) here. Returns the engine's reply, or
    raises what the load raised (the sender's `send` returned either way)."""
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(sender.send, named, version)
        try:
            return asyncio.run(receive_and_load(receiver, engine, version, "retract"))
        finally:
            assert sent.result(timeout=TIMEOUT_S).version == version


@pytest.mark.parametrize("names", ["stacked", "per_expert"])
@pytest.mark.parametrize("kind", PAIRS)
def test_a_moe_update_through_each_transport_makes_the_engine_a_fresh_one(kind, names, fresh):
    source = new_model()
    named = list(source.named_parameters())
    named = per_expert(named) if names == "per_expert" else named
    sender, receiver = PAIRS[kind][0](TIMEOUT_S)
    with Engine(build_model(CONFIG, seed=0), ENGINE) as engine, sender, receiver:
        generate(engine)  # KV of the old weights in the prefix cache: the update must not reuse it
        reply = sync(sender, receiver, engine, named, version=1)
        assert (reply.weight_version, reply.num_tensors, engine.weight_version) == (1, len(named), 1)
        assert digest(engine.model) == digest(source)
        assert_same(generate(engine), fresh)


BAD = {  # case -> (a tensor the update carries after all the good ones, in place of theirs, what the refusal says)
    "one expert short": ("model.layers.2.mlp.experts.gate_up_proj", torch.zeros(5, 96, 64), "shape"),
    "router of another width": ("model.layers.1.mlp.gate.weight", torch.zeros(6, 63), "shape"),
    "per-expert shape": ("model.layers.1.mlp.experts.3.down_proj.weight", torch.zeros(48, 64), "shape"),
    "expert the model lacks": ("model.layers.1.mlp.experts.6.up_proj.weight", torch.zeros(48, 64), "expert 6"),
    "expert of a dense layer": ("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(48, 64), "no experts"),
    "stacked name unknown": ("model.layers.1.mlp.experts.gate_proj", torch.zeros(6, 48, 64), "unknown parameter"),
}


@pytest.mark.parametrize("kind", PAIRS)
def test_a_bad_moe_update_through_each_transport_is_refused_and_changes_nothing(kind, fresh):
    good = per_expert(new_model().named_parameters())
    sender, receiver = PAIRS[kind][0](TIMEOUT_S)
    with Engine(build_model(CONFIG, seed=0), ENGINE) as engine, sender, receiver:
        before = digest(engine.model)
        for case, (name, tensor, says) in BAD.items():
            with pytest.raises(ValueError, match=says):
                sync(sender, receiver, engine, [*[(n, t) for n, t in good if n != name], (name, tensor)], version=1)
            assert digest(engine.model) == before, case
            assert engine.weight_version == 0 and engine.paused is None, case  # generating again
        sync(sender, receiver, engine, good, version=1)  # the transport and the engine took the next one
        assert_same(generate(engine), fresh)
