"""The engine's GPU path (CUDA graphs, Triton attention kernels, fused ops) against its CPU path, against its own
reference path on the same weights, and against Hugging Face's greedy generation."""

import asyncio
import dataclasses
import functools

import pytest
import torch
from hf_ref import SHAPES, hf_model, tandem_twin

from tandem.config import PRESETS, EngineConfig
from tandem.engine.engine import Engine
from tandem.model.loader import build_model
from tandem.types import SamplingParams

pytestmark = pytest.mark.gpu


def generate_all(engine, prompts, sampling):
    async def go():
        return await asyncio.gather(*[engine.generate(p, sampling) for p in prompts])

    return asyncio.run(go())


@pytest.mark.parametrize("small", [False, True], ids=["", "small_batch_kernels"])
def test_gpu_engine_matches_cpu_engine(small):
    """fp32, so the tokens must be equal: prompts sharing a prefix (cache hits, partial pages) and chunked
    prefill beside decodes; also with the few-row kernels (`small_batch_kernels`)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (int(n),), generator=gen).tolist() for n in torch.randint(3, 90, (24,),
                                                                                              generator=gen)]
    prompts += [prompts[0] * 3 + [5, 6, 7][:i] for i in range(3)]
    greedy = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=40, ignore_eos=True, seed=5)
    results = {}
    for device in ("cpu", "cuda"):
        model = build_model("tiny", seed=1).to(device)
        config = EngineConfig(device=device, page_size=16, num_pages=512, max_prefill_tokens=48,
                              small_batch_kernels=small)
        with Engine(model, config) as engine:
            if device == "cuda":
                assert engine.runner.graphs, "decode should replay CUDA graphs"
                assert engine.runner.mixed_graphs, "steps that prefill should replay CUDA graphs"
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


def test_fast_path_greedy_agrees_with_the_reference_path_in_bf16():
    """64 mixed-length requests, greedy, bf16: CUDA graphs + Triton kernels against the same engine with both
    off. bf16 near-ties may flip a token; every request that differs in its first 32 tokens must differ first
    where the two paths' chosen tokens had nearly the same logprob."""
    config = dataclasses.replace(PRESETS["qwen3-0.6b"], num_hidden_layers=6)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 20000, (int(n),), generator=gen).tolist() for n in torch.randint(5, 400, (64,),
                                                                                                  generator=gen)]
    greedy = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
    outs = []
    for fast in (True, False):
        model = build_model(config, device="cuda", dtype="bfloat16", seed=3)
        cfg = EngineConfig(device="cuda", page_size=16, num_pages=4096, cuda_graphs=fast, fused_kernels=fast)
        with Engine(model, cfg) as engine:
            outs.append(generate_all(engine, prompts, greedy))
    agree = 0
    for f, r in zip(*outs, strict=True):
        if f.output_ids == r.output_ids:
            agree += 1
            continue
        i = next(i for i, (a, b) in enumerate(zip(f.output_ids, r.output_ids, strict=True)) if a != b)
        assert abs(f.output_logprobs[i] - r.output_logprobs[i]) < 0.1, f"request diverged at token {i} on no tie"
    print(f"fast path vs reference, bf16: {agree}/64 requests agree on all 32 tokens")
    assert agree >= 32


@pytest.mark.parametrize("small", [False, True], ids=["", "small_batch_kernels"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_gpu_engine_greedy_equals_hugging_face_at_any_even_head_dim(head_dim, small):
    """fp32, random weights: the engine's GPU path (Triton attention with padded head blocks, fused q/k norm +
    RoPE, CUDA graphs) generates Hugging Face's greedy tokens, with chunked prefill over a long prompt."""
    config = dataclasses.replace(SHAPES["gqa2_tied"], hidden_size=128, intermediate_size=192, head_dim=head_dim,
                                 vocab_size=512)
    hf = hf_model(config)
    gen = torch.Generator().manual_seed(head_dim)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (3, 21, 70)]
    num_new = 24
    model = tandem_twin(hf, config).to("cuda")
    config = EngineConfig(device="cuda", page_size=16, num_pages=64, max_prefill_tokens=32, small_batch_kernels=small)
    with Engine(model, config) as engine:
        assert engine.model.fused is not None and engine.runner.graphs and (engine.model.small is not None) == small
        outs = generate_all(engine, prompts, SamplingParams(temperature=0, max_new_tokens=num_new, ignore_eos=True))
    hf = hf.to("cuda")
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        want = hf.generate(ids, max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False)[0, len(prompt):]
        assert out.output_ids == want.tolist()


@pytest.mark.parametrize("at_once", [1, 2])
def test_gpu_engine_greedy_equals_hugging_face_one_or_two_at_a_time(at_once):
    """fp32: decode steps of one or two rows, the few-row kernels' vector tiles (`small_linear.VECTOR_ROWS`),
    generate Hugging Face's greedy tokens."""
    from tandem.kernels import small_linear

    assert at_once <= small_linear.VECTOR_ROWS
    config = dataclasses.replace(SHAPES["gqa2_tied"], hidden_size=256, intermediate_size=384, head_dim=128,
                                 vocab_size=512)
    hf = hf_model(config)
    gen = torch.Generator().manual_seed(at_once)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (9, 40)[:at_once]]
    model = tandem_twin(hf, config).to("cuda")
    with Engine(model, EngineConfig(device="cuda", page_size=16, num_pages=64, small_batch_kernels=True)) as engine:
        outs = generate_all(engine, prompts, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))
    hf = hf.to("cuda")
    for prompt, out in zip(prompts, outs, strict=True):
        want = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=24, min_new_tokens=24,
                           do_sample=False)[0, len(prompt):]
        assert out.output_ids == want.tolist()


def test_a_steps_results_are_read_without_waiting_for_the_step_launched_after_it():
    """Sampled ids, logprobs and top logprobs reach pinned host memory behind the step's own event: reading them
    never waits for the work queued after it (the next step; here a sleep of about a second)."""
    from types import SimpleNamespace

    from tandem.engine.model_runner import Launched, ModelRunner
    from tandem.engine.streams import StreamRuntime, engine_placements

    device = torch.device("cuda")
    on = functools.partial(torch.tensor, device=device)
    launched = Launched([], tokens=on([5, 7]), logprobs=on([-1.0, -2.0]),
                        top=(on([[-1.0, -3.0], [-2.0, -4.0]]), on([[5, 6], [7, 8]])))
    ModelRunner._copy_out(SimpleNamespace(order=StreamRuntime(engine_placements(), device)), launched)
    torch.cuda._sleep(2_000_000_000)  # (clock cycles: the step launched next)
    assert launched.result() == ([5, 7], [-1.0, -2.0])
    assert launched.top_result() == [[(-1.0, 5), (-3.0, 6)], [(-2.0, 7), (-4.0, 8)]]
    assert not torch.cuda.current_stream().query(), "reading the results waited for the work queued after them"
    torch.cuda.synchronize()
