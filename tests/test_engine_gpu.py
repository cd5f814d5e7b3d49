"""The engine's GPU path (CUDA graphs, Triton decode kernel) against its CPU path on the same weights."""

import asyncio

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.model.loader import build_model
from tandem.types import SamplingParams

pytestmark = pytest.mark.gpu


def generate_all(engine, prompts, sampling):
    async def go():
        return await asyncio.gather(*[engine.generate(p, sampling) for p in prompts])

    return asyncio.run(go())


def test_gpu_engine_matches_cpu_engine():
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (int(n),), generator=gen).tolist() for n in torch.randint(3, 90, (24,),
                                                                                              generator=gen)]
    greedy = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=40, ignore_eos=True, seed=5)
    results = {}
    for device in ("cpu", "cuda"):
        model = build_model("tiny", seed=1).to(device)
        with Engine(model, EngineConfig(device=device, page_size=16, num_pages=512)) as engine:
            if device == "cuda":
                assert engine.runner.graphs, "decode should replay CUDA graphs"
            results[device] = (generate_all(engine, prompts, greedy), generate_all(engine, prompts, seeded))
    for cpu_outs, gpu_outs in zip(results["cpu"], results["cuda"], strict=True):
        for c, g in zip(cpu_outs, gpu_outs, strict=True):
            assert c.output_ids == g.output_ids
            assert c.output_logprobs == pytest.approx(g.output_logprobs, abs=2e-3)


def test_bf16_engine_on_gpu_generates_and_reports_finite_logprobs():
    with Engine("qwen3-0.6b", EngineConfig(device="cuda", num_pages=0, page_size=16), dtype="bfloat16") as engine:
        outs = generate_all(engine, [[1, 2, 3] * 40, [7] * 300], SamplingParams(max_new_tokens=64, ignore_eos=True))
    assert all(len(o.output_ids) == 64 for o in outs)
    assert all(torch.isfinite(torch.tensor(o.output_logprobs)).all() for o in outs)
