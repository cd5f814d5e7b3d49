"""A decode step's inputs through one pinned buffer (`tandem.engine.step_inputs`): what lands on the device."""

from types import SimpleNamespace

import pytest
import torch

from tandem.engine.request import Request
from tandem.engine.scheduler import PENDING, Chunk
from tandem.engine.step_inputs import ROW_BYTES, DecodeInputs
from tandem.types import SamplingParams

POOL = SimpleNamespace(page_size=4, scratch_slot=99)


def _request(tokens, pages, seed, **sampling) -> Request:
    """Two prompt tokens, the rest generated."""
    return Request(rid=f"r{seed}", tokens=tokens, prompt_len=2, sampling=SamplingParams(**sampling), seed=seed,
                   arrival=seed, pages=pages)


def _send(inputs: DecodeInputs, reqs, bs: int):
    chunks = [Chunk(r, len(r.tokens) - 1, 1) for r in reqs]
    width = max(len(r.pages) for r in reqs)
    table = torch.full((bs, 8), -1, dtype=torch.int32)
    pending, sampling = inputs.send(chunks, bs, POOL, table[:, :width], vocab_size=1000)
    pending = pending and [t.tolist() for t in pending]
    return pending, sampling, table, {k: v.tolist() for k, v in inputs.views(bs).items()}


def test_the_vectors_do_not_overlap():
    inputs = DecodeInputs([1, 3, 4], torch.device("cpu"))
    for bs in (1, 3, 4):
        views = inputs.views(bs)
        assert len(views) == 12 and all(v.shape == (bs,) for v in views.values())
        for i, view in enumerate(views.values()):
            view.fill_(i + 1)
    for bs in (1, 3, 4):  # (each kept its own values)
        assert [v.tolist() for v in inputs.views(bs).values()] == [[i + 1] * bs for i in range(12)]
    assert inputs.buffer.numel() == ROW_BYTES * 8


def test_a_step_lands_as_the_rows_ask_and_padding_rows_are_reset_every_step():
    inputs = DecodeInputs([1, 2, 4], torch.device("cpu"))
    a = _request([5, 6, 7, 8, 9], [3, 1], seed=11, temperature=0.5, top_k=7, top_p=0.9)
    b = _request([5, 6, PENDING], [2], seed=12, min_p=0.1)
    b.pending_row = 3
    c = _request([5, 6, 7], [4], seed=13)
    pending, sampling, table, d = _send(inputs, [a, b, c], 4)
    assert pending == [[1], [3]] and d["pending_rows"][1:] == [0] * 3
    assert d["ids"] == [9, 0, 7, 0] and d["positions"] == [4, 2, 2, 0] and d["seq_lens"] == [5, 3, 3, 0]
    assert d["slots"] == [1 * 4 + 0, 2 * 4 + 2, 4 * 4 + 2, POOL.scratch_slot]  # (position 4 is page 1's first)
    assert table.tolist() == [[3, 1, -1, -1, -1, -1, -1, -1], [2, 0, -1, -1, -1, -1, -1, -1],
                              [4, 0, -1, -1, -1, -1, -1, -1], [0, 0, -1, -1, -1, -1, -1, -1]]
    assert sampling.temperatures.tolist() == [0.5, 1.0, 1.0] and sampling.top_ks.tolist() == [7, -1, -1]
    assert sampling.seeds.tolist() == [11, 12, 13] and sampling.positions.tolist() == [3, 1, 1]
    assert sampling.min_ps.tolist() == pytest.approx([0.0, 0.1, 0.0]) and sampling.needs_filter
    # the next step of the same size has fewer rows: the rows it pads must not keep the last step's lengths and
    # slots, or the graph would attend over them and write a key into another request's page
    pending, sampling, _, d = _send(inputs, [c], 4)
    assert pending is None and d["ids"][1:] == [0] * 3 and d["seq_lens"][1:] == [0] * 3
    assert d["slots"][1:] == [POOL.scratch_slot] * 3 and d["positions"][1:] == [0] * 3
    assert not sampling.needs_filter and sampling.seeds.tolist() == [13]


def test_a_value_its_vector_cannot_hold_raises():
    inputs = DecodeInputs([1], torch.device("cpu"))
    with pytest.raises(OverflowError):
        _send(inputs, [_request([5, 6, 7], [1], seed=2**70)], 1)
