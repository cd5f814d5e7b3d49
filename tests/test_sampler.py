"""The sampler: exact logprobs, the sampled distribution before and after truncation, and per-request noise.

Every statistical test uses a fixed set of seeds, so it is deterministic: the bounds are chosen so that a
correct sampler passes with a wide margin (a chi-square p-value of about 1e-4) and a plausible mistake fails
clearly (a temperature off by 10% gives three times the bound; renormalising in the wrong order samples a
token outside the allowed set).
"""

import asyncio
import dataclasses
import math

import pytest
import torch

from tandem.engine import sampler
from tandem.engine.sampler import SamplingBatch, _filter, hash_uniform, sample


def batch(B, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seeds=None, positions=None) -> SamplingBatch:
    def col(x, dtype):
        return torch.as_tensor(x, dtype=dtype).expand(B).clone()

    return SamplingBatch(
        temperatures=col(temperature, torch.float32), top_ps=col(top_p, torch.float32),
        top_ks=col(top_k, torch.int64), min_ps=col(min_p, torch.float32),
        seeds=torch.arange(B, dtype=torch.int64) if seeds is None else col(seeds, torch.int64),
        positions=torch.zeros(B, dtype=torch.int64) if positions is None else col(positions, torch.int64))


def draw(logits_V: torch.Tensor, n: int, **params) -> torch.Tensor:
    """n samples of one distribution: one row per seed 0..n-1, all at the same position."""
    tokens, _ = sample(logits_V.expand(n, -1).clone(), batch(n, **params))
    return tokens


def chi_square_bound(df: int, z: float = 3.72) -> float:
    """The chi-square quantile at p ~ 1e-4 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_frequencies(tokens: torch.Tensor, probs_V: torch.Tensor) -> None:
    """Only tokens with positive probability appear, with frequencies matching `probs_V` (chi-square)."""
    counts = torch.bincount(tokens, minlength=len(probs_V)).double()
    support = probs_V > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts[~support].nonzero().tolist()}"
    expected = len(tokens) * probs_V.double()[support]
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    assert stat < chi_square_bound(int(support.sum()) - 1), (stat, counts[support].tolist(), expected.tolist())


# Distinct probabilities, logits = log p at temperature 1.
PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
LOGITS = PROBS.log()


def test_greedy_rows_take_the_argmax_and_report_the_temperature_one_logprob():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0)) * 3
    temps = torch.tensor([0, 0.7, 0, 1.5, 0, 1.0, 0, 0.3])
    params = batch(8, temperature=0.0, top_k=3, top_p=0.5)
    params.temperatures = temps
    tokens, logprobs = sample(logits, params)
    greedy = temps == 0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    ref = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    assert torch.equal(logprobs[greedy], ref[greedy])


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("filters", [{}, dict(top_k=2), dict(top_p=0.5), dict(min_p=0.5), dict(top_k=1)])
def test_logprob_is_log_softmax_of_scaled_logits_before_truncation(temperature, filters):
    logits = torch.randn(16, 40, generator=torch.Generator().manual_seed(1)) * 2
    tokens, logprobs = sample(logits, batch(16, temperature=temperature, **filters))
    ref = torch.log_softmax(logits / temperature, -1).gather(1, tokens[:, None])[:, 0]
    assert torch.equal(logprobs, ref)
    if filters.get("top_k") == 1:  # truncated to one token, yet not renormalised to logprob 0
        assert (logprobs < 0).all()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampled_frequencies_match_softmax_of_scaled_logits(temperature):
    tokens = draw(LOGITS, 20000, temperature=temperature)
    assert_frequencies(tokens, torch.softmax(LOGITS / temperature, -1))


@pytest.mark.parametrize("filters, allowed", [
    (dict(top_k=3), [0, 1, 2]),
    (dict(top_p=0.6), [0, 1]),  # masses before each token: 0, .40, .65: the token crossing .6 stays
    (dict(top_p=0.7), [0, 1, 2]),
    (dict(min_p=0.3), [0, 1, 2]),  # p >= 0.3 * 0.40
    (dict(min_p=0.5), [0, 1]),
    # top-p acts after top-k renormalises: [.5, .3125, .1875] reaches .8 at token 1 (without it: token 2)
    (dict(top_k=3, top_p=0.8), [0, 1]),
    (dict(top_k=4, min_p=0.3, top_p=0.9), [0, 1, 2]),
])
def test_truncation_samples_only_allowed_tokens_with_renormalised_frequencies(filters, allowed):
    tokens = draw(LOGITS, 20000, **filters)
    probs = torch.zeros_like(PROBS)
    probs[allowed] = PROBS[allowed] / PROBS[allowed].sum()
    assert_frequencies(tokens, probs)


def test_truncation_applies_to_the_temperature_scaled_distribution():
    # at T = 2 the distribution flattens: top-p 0.6 needs three tokens instead of two
    scaled = torch.softmax(LOGITS / 2, -1)
    assert scaled[:2].sum() < 0.6 < scaled[:3].sum()
    tokens = draw(LOGITS, 20000, temperature=2.0, top_p=0.6)
    probs = torch.zeros_like(PROBS)
    probs[:3] = scaled[:3] / scaled[:3].sum()
    assert_frequencies(tokens, probs)


def test_tiny_top_p_keeps_exactly_the_argmax():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(2))
    tokens = draw(logits, 4000, top_p=1e-6, temperature=5.0)
    assert (tokens == logits.argmax()).all()


@pytest.mark.parametrize("filters", [dict(top_p=1e-6), dict(top_k=1), dict(min_p=0.999)])
def test_ties_at_the_top_yield_a_tied_maximum(filters):
    logits = torch.zeros(32)
    logits[[5, 17, 30]] = 3.0
    tokens = draw(logits, 4000, **filters)
    assert set(tokens.tolist()) <= {5, 17, 30}


def test_without_truncation_ties_are_sampled_evenly():
    logits = torch.zeros(8)
    logits[[1, 6]] = 4.0
    tokens = draw(logits, 20000, temperature=1.0)
    assert_frequencies(tokens, torch.softmax(logits, -1))


# (temperature, top_p, top_k, min_p, seed, position): no truncation, top-k, top-p with min-p
TARGETS = [(0.8, 1.0, -1, 0.0, 12345, 7), (1.3, 1.0, 5, 0.0, 2**62 + 3, 0), (1.0, 0.7, -1, 0.05, 99, 1000)]
FIELDS = ("temperatures", "top_ps", "top_ks", "min_ps", "seeds", "positions")


@pytest.mark.parametrize("target", TARGETS)
def test_a_rows_token_depends_only_on_its_seed_position_and_logits(target):
    gen = torch.Generator().manual_seed(3)
    V = 64
    target_logits = torch.randn(V, generator=gen) * 2
    alone_token, alone_logprob = sample(target_logits[None].clone(), batch(1, *target))
    for B, row in [(2, 0), (5, 3), (33, 32)]:
        logits = torch.randn(B, V, generator=gen) * 3
        logits[row] = target_logits
        params = batch(B, temperature=torch.rand(B, generator=gen) * 2, top_p=torch.rand(B, generator=gen) + 0.2,
                       top_k=torch.randint(-1, 10, (B,), generator=gen), min_p=torch.rand(B, generator=gen) * 0.3,
                       seeds=torch.randint(0, 2**62, (B,), generator=gen),
                       positions=torch.randint(0, 500, (B,), generator=gen))
        params.temperatures[0] = 0.0  # a greedy neighbour too
        for name, value in zip(FIELDS, target, strict=True):
            getattr(params, name)[row] = value
        tokens, logprobs = sample(logits, params)
        assert tokens[row] == alone_token[0] and logprobs[row] == alone_logprob[0], (B, row)


def test_uniforms_lie_inside_the_open_unit_interval_and_look_uniform():
    u = hash_uniform(torch.arange(64, dtype=torch.int64) * 1_000_003, torch.arange(64, dtype=torch.int64), 4096)
    assert u.dtype == torch.float32 and u.shape == (64, 4096)
    assert u.min() > 0 and u.max() < 1
    flat = u.double().flatten()
    n = len(flat)
    assert abs(flat.mean().item() - 0.5) < 4 * math.sqrt(1 / 12 / n)
    assert abs(flat.var().item() - 1 / 12) < 4 * math.sqrt(1 / 180 / n)  # var of (U - 1/2)^2 is 1/180
    assert_frequencies((u.flatten() * 32).long(), torch.full((32,), 1 / 32))


def test_uniforms_are_a_pure_function_that_differs_across_seeds_and_positions():
    seeds = torch.tensor([7, 8, 7, 7 + 2**32, 2**62 + 7, 7], dtype=torch.int64)
    positions = torch.tensor([0, 0, 1, 0, 0, 0], dtype=torch.int64)
    u = hash_uniform(seeds, positions, 8192).double()
    assert torch.equal(u[0], u[5])
    assert torch.equal(u, hash_uniform(seeds, positions, 8192).double())
    assert torch.equal(u[:, :100], hash_uniform(seeds, positions, 100).double())  # the vocab size is not an input
    corr = torch.corrcoef(u[:5])
    off_diagonal = corr[~torch.eye(5, dtype=torch.bool)]
    assert off_diagonal.abs().max() < 0.05, corr  # |r| for independent rows ~ 1/sqrt(8192) = 0.011


def test_the_extreme_hashes_map_strictly_inside_the_unit_interval(monkeypatch):
    """Whatever the hash, a uniform of exactly 0 or 1 would be infinite Gumbel noise."""
    for extreme in (0, 0xFFFFFFFF):
        monkeypatch.setattr(sampler, "_mix32", lambda x, e=extreme: torch.full_like(x, e))
        u = hash_uniform(torch.tensor([1]), torch.tensor([0]), 4)
        assert u.min() > 0 and u.max() < 1, (extreme, u)


# (seed, position, vocab index) where ((x >> 8).float() + 0.5) / 2**24, the first formula, rounded up to 1.0
# in float32: one input in 2**24, i.e. about one row in 110 at a 152k vocabulary.
SATURATED_ONCE = (120, 0, 10681)


def test_the_input_that_once_gave_a_uniform_of_one_gives_less():
    seed, position, index = SATURATED_ONCE
    u = hash_uniform(torch.tensor([seed]), torch.tensor([position]), index + 1)
    assert u[0, index] < 1


@pytest.mark.parametrize("filters", [{}, dict(top_k=1), dict(top_p=0.5), dict(min_p=0.5)])
def test_a_token_of_negligible_probability_is_never_sampled(filters):
    """A uniform of 1 made infinite noise: that token won whatever its probability, and even when truncation
    had removed it (-inf + inf = nan wins the argmax)."""
    seed, position, index = SATURATED_ONCE
    logits = torch.zeros(1, index + 1)
    logits[0, 0] = 50.0  # every other token has probability ~ e^-50
    tokens, _ = sample(logits, batch(1, seeds=seed, positions=position, **filters))
    assert tokens[0] == 0


def test_a_row_without_truncation_keeps_every_token_when_batched_with_truncating_rows():
    """A float32 cumsum can reach 1 before the tail: a top_p = 1 row must not go through the nucleus mask, or
    its tail tokens are dropped and its samples depend on its neighbours."""
    V = 151936  # Qwen3's vocabulary
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0)) * 3
    filtered = _filter(logits, batch(2, top_k=torch.tensor([5, -1])))
    assert torch.isfinite(filtered[1]).all(), f"{int(torch.isinf(filtered[1]).sum())} tokens dropped"



def on(device: str, b: SamplingBatch) -> SamplingBatch:
    """`b` with its tensors on `device`."""
    return dataclasses.replace(b, **{f.name: getattr(b, f.name).to(device) for f in dataclasses.fields(b)
                                     if isinstance(getattr(b, f.name), torch.Tensor)})


def _banning(device: str) -> tuple[SamplingBatch, list]:
    """A one-row batch on `device` and its request, under its min_new_tokens with stop tokens 9 and 11."""
    from tandem.engine.request import Request
    from tandem.types import SamplingParams

    req = Request(rid="r", tokens=[5, 6, 7], prompt_len=3, seed=1, arrival=0,
                  sampling=SamplingParams(min_new_tokens=4, stop_token_ids=[9, 11]))
    return on(device, batch(1)), [req]


def test_a_request_under_its_min_new_tokens_bans_its_stop_tokens_and_eos():
    out = sampler.with_requests(*_banning("cpu"), eos_token_id=2)
    assert out.banned[0].tolist() == [0, 0, 0] and out.banned[1].tolist() == [9, 11, 2]


@pytest.mark.gpu
def test_banned_tokens_reach_the_device_without_the_host_waiting_for_it():
    """The banned ids go to the device without the host waiting for the work queued before them (the step in
    flight; here a sleep of about a second), as every input of a step does."""
    b, reqs = _banning("cuda")
    torch.cuda._sleep(2_000_000_000)  # (clock cycles: about a second of queued work)
    out = sampler.with_requests(b, reqs, eos_token_id=2)
    assert not torch.cuda.current_stream().query(), "the host waited for the queued work"
    torch.cuda.synchronize()
    assert out.banned[0].tolist() == [0, 0, 0] and out.banned[1].tolist() == [9, 11, 2]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("filters", [{}, dict(top_k=5), dict(top_p=0.5), dict(min_p=0.2)])
def test_logits_in_bf16_sample_the_tokens_their_fp32_conversion_samples(device, filters):
    """The engine hands the sampler its logits in the model's dtype (`compute_logits(float32=False)`): sampling
    them (every path: the fused pass on CUDA, the filters, banned tokens, top logprobs) gives the very tokens that
    sampling their exact fp32 conversion gives, and the same logprobs, the fused pass's to within fp32 rounding."""
    B, V = 6, 151936
    logits = (torch.randn(B, V, generator=torch.Generator().manual_seed(3)) * 4).to(device, torch.bfloat16)
    b = on(device, batch(B, temperature=torch.tensor([0.0, 0.7, 1.0, 1.3, 0.5, 2.0]), seeds=torch.arange(B) * 7,
                         positions=torch.arange(B), **filters))
    b.needs_filter = bool(filters)
    b.banned = (torch.tensor([1, 1, 4], device=device), torch.tensor([0, 17, 99], device=device))
    b.top_logprobs_num = 3
    (tokens, logprobs), (want_tokens, want_logprobs) = sample(logits, b), sample(logits.float(), b)
    assert torch.equal(tokens, want_tokens) and logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=0 if device == "cpu" or filters else 4e-6)
    top, want_top = sampler.top_logprobs(logits, b), sampler.top_logprobs(logits.float(), b)
    assert torch.equal(top[0], want_top[0]) and torch.equal(top[1], want_top[1])


def test_the_engine_hands_the_sampler_its_logits_in_the_models_dtype(monkeypatch):
    """No conversion pass over [rows, vocab] before sampling: a bf16 model's logits reach `sample` in bf16 (the
    decode and the mixed steps alike), and the tokens are the model's own (greedy, the same as with fp32)."""
    from tandem.engine import model_runner
    from tandem.engine.engine import Engine
    from tandem.types import SamplingParams

    seen = []
    monkeypatch.setattr(model_runner, "sample", lambda logits, b: seen.append(logits.dtype) or sample(logits, b))
    with Engine("tiny", dtype="bfloat16") as engine:
        out = asyncio.run(engine.generate([3, 4, 5, 6], SamplingParams(max_new_tokens=4, temperature=0.0)))
    assert len(out.output_ids) == 4 and seen and set(seen) == {torch.bfloat16}
