"""The KV transfer's kept host buffers (`kv_shared.Staging`): handed out again only once the device is past the copy
that used them (falsifier: a fake event not yet reached), none allocated per transfer on the kernel's path; on the
GPU the same through page-locked buffers and real events."""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so before the import

from tandem.engine import kv_index_sums  # noqa: E402
from tandem.engine.kv_index_sums import canonical, host_sums, page_sums_by_index  # noqa: E402
from tandem.engine.kv_shared import Staging, staging  # noqa: E402


class Event:
    """A device event as `Staging` reads it: reached or not."""

    def __init__(self, reached: bool = False):
        self.reached = reached

    def query(self) -> bool:
        return self.reached


def test_a_kept_buffer_is_handed_out_again_only_once_the_device_is_past_its_copy():
    stage = Staging(pin=False)
    a = stage.take(100)
    copy = Event()
    stage.give(a, copy)  # (a copy still reads or writes it)
    b = stage.take(100)
    assert b is not a and stage.allocated == 2  # falsifier: a buffer handed out under a copy in flight
    stage.give(b)
    copy.reached = True
    assert stage.take(100) is a and stage.take(100) is b and stage.allocated == 2
    assert stage.take(a.data.numel() + 1).data.numel() > a.data.numel()  # (too small: a new one)


def test_at_most_keep_free_buffers_are_kept():
    stage = Staging(pin=False, keep=2)
    bufs = [stage.take(10) for _ in range(3)]
    for buf in bufs:
        stage.give(buf)
    assert [stage.take(10) for _ in range(3)][2] not in bufs and stage.allocated == 4


def test_a_buffer_the_device_may_still_read_is_never_dropped():
    """Dropped, its page-locked memory could be handed to another allocation while a pass queued behind a doorbell
    has still to read its page index from it (falsifier: the count alone, which dropped the third)."""
    stage = Staging(pin=False, keep=2)
    bufs, copies = [stage.take(10) for _ in range(3)], [Event() for _ in range(3)]
    for buf, copy in zip(bufs, copies, strict=True):
        stage.give(buf, copy)
    assert stage._free == bufs
    for copy in copies:
        copy.reached = True
    stage.give(stage.take(10))  # (now past them all: beyond `keep` they go)
    assert len(stage._free) == 2


def test_the_kernels_path_allocates_no_host_buffer_per_transfer(monkeypatch):
    """`page_sums_by_index` stages its page index in a kept buffer and gives it back: a second transfer of the same
    size takes the same buffer (the kernel under the interpreter here)."""
    pytest.importorskip("triton")
    monkeypatch.setattr(kv_index_sums, "_kernel_ok", lambda *caches: True)
    k, v = torch.randn(2, 5 * 4, 2, 4), torch.randn(2, 5 * 4, 2, 4)
    stage = staging("cpu")
    first = page_sums_by_index(k, v, [1, 2, 3], 0, 10, 4)
    made = stage.allocated
    for _ in range(3):
        assert torch.equal(page_sums_by_index(k, v, [1, 2, 3], 0, 10, 4), first)
    assert stage.allocated == made  # falsifier: one buffer a transfer


@pytest.mark.gpu
def test_on_the_gpu_sums_come_back_through_kept_page_locked_buffers():
    """`host_sums` on the device: the same values as `.cpu()`, through one page-locked buffer reused call after
    call; `page_sums_by_index` with the kernel gives its buffer back behind a real event."""
    sums = torch.randint(-2**40, 2**40, (512, 2), dtype=torch.int64, device="cuda")
    stage = staging(sums.device)
    want = canonical(sums.cpu().numpy())
    assert np.array_equal(host_sums(sums), want)
    made = stage.allocated
    for _ in range(3):
        assert np.array_equal(host_sums(sums), want)
    assert stage.allocated == made and stage._free[0].data.is_pinned()
    k, v = torch.randn(28, 80 * 16, 8, 128, device="cuda").bfloat16(), torch.randn(28, 80 * 16, 8, 128,
                                                                                 device="cuda").bfloat16()
    first = host_sums(page_sums_by_index(k, v, list(range(40)), 0, 630, 16))
    made = stage.allocated
    for _ in range(3):
        assert np.array_equal(host_sums(page_sums_by_index(k, v, list(range(40)), 0, 630, 16)), first)
    assert stage.allocated == made
