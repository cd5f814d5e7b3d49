"""One client can never hurt another: hostile sampling parameters are refused before they reach the engine, and a
request whose inputs still fail a step fails alone, while the requests batched with it finish exactly as alone."""

import asyncio
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.config import EngineConfig
from tandem.engine.commands import AddRequest
from tandem.engine.engine import Engine
from tandem.types import SamplingParams

INNOCENT = [([5, 6, 7, i], SamplingParams(temperature=1.0, max_new_tokens=24, seed=i, ignore_eos=True))
            for i in range(4)] + [([9, 8, 7], SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))]


@pytest.fixture(scope="module")
def engine():
    with Engine("tiny", EngineConfig(page_size=4, num_pages=256, max_prefill_tokens=64)) as engine:
        yield engine


@pytest.fixture(scope="module")
def alone(engine):
    return [_essence(asyncio.run(engine.generate(p, sp))) for p, sp in INNOCENT]


def _essence(out):
    return out.output_ids, out.finish_reason.to_dict()


async def _beside_innocent(engine, hostile):
    """The innocent requests with `hostile` (coroutines) submitted among them; returns their outputs, the hostile
    ones' results or exceptions."""
    innocent = [asyncio.create_task(engine.generate(p, sp)) for p, sp in INNOCENT]
    results = await asyncio.gather(*hostile, return_exceptions=True)
    return [await t for t in innocent], results


def _unchecked(**fields) -> SamplingParams:
    """Sampling parameters that skipped validation (a bug in a check, or a caller that bypassed it)."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    for name, value in fields.items():
        object.__setattr__(sp, name, value)
    return sp


@pytest.mark.parametrize("fields", [dict(top_k=2**63), dict(top_k=-2**64), dict(seed=2**70),
                                    dict(temperature="hot")])
def test_a_request_whose_inputs_fail_the_step_fails_alone(engine, alone, fields):
    """Values the validation refuses, forced into the engine beside innocent requests: the step that cannot build
    its tensors fails only that request (an abort naming its sampling parameters); the others finish exactly as
    when alone. (Without the culprit search the engine aborted the whole batch.)"""
    core = engine.core

    async def hostile():
        loop, fut = asyncio.get_running_loop(), asyncio.Future()
        sp = _unchecked(**fields)
        engine._inbox.put((AddRequest("hostile", [1, 2, 3], sp), _bridge(loop, fut)))
        return await fut

    outs, [bad] = asyncio.run(_beside_innocent(engine, [hostile()]))
    assert [_essence(o) for o in outs] == alone
    assert bad.finish_reason.type == "abort" and "sampling parameters" in bad.finish_reason.message, bad
    assert core.pool.num_free + (core.cache.num_pages if core.cache else 0) == core.pool.num_pages


def _bridge(loop, fut):
    """A concurrent future that resolves the asyncio future `fut` (the facade's own futures work this way)."""
    from concurrent.futures import Future

    bridge = Future()
    bridge.add_done_callback(lambda f: loop.call_soon_threadsafe(
        fut.set_exception if f.exception() else fut.set_result, f.exception() or f.result()))
    return bridge


HOSTILE_VALUES = st.one_of(st.integers(min_value=-2**80, max_value=2**80), st.floats(allow_nan=True),
                           st.booleans(), st.none(), st.text(max_size=3), st.lists(st.integers(-2**70, 2**70),
                                                                                   max_size=3))
FIELDS = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "ignore_eos", "stop_token_ids", "seed"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.dictionaries(st.sampled_from(FIELDS), HOSTILE_VALUES, max_size=4), min_size=1, max_size=3),
       st.lists(st.integers(-2**70, 2**70), min_size=0, max_size=4))
def test_random_hostile_requests_never_change_an_innocent_one(engine, alone, hostile_sampling, hostile_ids):
    """Random hostile requests (any field, any value) through the public API beside innocent ones: each is refused
    with a ValueError naming a field, or runs; the innocent requests finish exactly as alone and nothing leaks."""
    def submit(raw):
        try:
            sp = SamplingParams.from_dict(raw)
            sp = dataclasses.replace(sp, max_new_tokens=min(sp.max_new_tokens, 16))
        except ValueError as e:
            return _refused(e)
        return engine.generate(hostile_ids or [1], sp)

    async def _refused(error):
        raise error

    outs, results = asyncio.run(_beside_innocent(engine, [submit(raw) for raw in hostile_sampling]))
    assert [_essence(o) for o in outs] == alone
    for r in results:
        if isinstance(r, BaseException):
            assert isinstance(r, ValueError) and ("sampling_params." in str(r) or "input_ids" in str(r)), r
        else:
            assert r.finish_reason.type != "abort", r.finish_reason
    core = engine.core
    assert core.pool.num_free + (core.cache.num_pages if core.cache else 0) == core.pool.num_pages


@pytest.mark.parametrize("field, value", [("top_k", 2**63), ("top_k", -2**63 - 1), ("temperature", 1e-40),
                                          ("temperature", float("inf")), ("max_new_tokens", 2**63),
                                          ("seed", 2**63), ("stop_token_ids", [2**64])])
def test_values_that_would_overflow_the_engine_are_refused_naming_the_field(field, value):
    """The values a hostile client used to abort everyone's requests (an int64 overflow while the step built its
    tensors) or to get wrong tokens (a temperature whose scaled logits overflow) are a ValueError naming them."""
    with pytest.raises(ValueError, match=f"sampling_params.{field}"):
        SamplingParams.from_dict({field: value})
