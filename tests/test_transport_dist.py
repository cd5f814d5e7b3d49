"""Weight transport over torch.distributed, its own behaviour beyond the common contract (test_transport.py):
bit-identical delivery in buckets of mixed dtypes with collectives per bucket (not per tensor) over two real gloo
processes, metadata split over frames, the switch interval restored, timeouts and stalls that name the peer, a rank
that never joins, bad arguments, bucket metadata, and NCCL between two GPUs."""

import sys
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp
from test_transport import (
    BUCKET_BYTES,
    ENGINE_LABEL,
    TIMEOUT_S,
    count_broadcasts,
    digest,
    failure,
    free_port,
    mixed_model,
    run_pair,
)

from tandem.model.loader import load_weights
from tandem.transport import dist as transport_dist
from tandem.transport import switch
from tandem.transport.buckets import back_to_back
from tandem.transport.dist import BucketMeta, DistReceiver, DistSender
from tandem.transport.weights import TransportError

# ---- torch.distributed ------------------------------------------------------------------------------------------


def roundtrip_worker(rank: int, results, port: int, meta_bytes: int):
    torch.set_num_threads(1)
    transport_dist.META_BYTES = meta_bytes
    init, model = f"tcp://127.0.0.1:{port}", mixed_model(seed=rank)
    try:
        if rank == 0:
            with DistSender(init, 2, timeout_s=30, bucket_bytes=BUCKET_BYTES, label="trainer") as sender:
                with pytest.raises(ValueError, match="given twice"):  # caught before the hello: in the first bucket
                    sender.send([("w", torch.zeros(2)), ("w", torch.zeros(2))], version=5)

                def bad():  # a duplicate name after two buckets' worth of tensors: caught mid-transfer
                    yield from list(model.named_parameters())[:6]
                    yield "lm_head.weight", model.lm_head.weight
                    yield "lm_head.weight", model.lm_head.weight
                with pytest.raises(ValueError, match="given twice"):
                    sender.send(bad(), version=6)
                calls = count_broadcasts(sender)
                inner, switch = sender._send, [sys.getswitchinterval()]
                sender._send = lambda *args: switch.append(sys.getswitchinterval()) or inner(*args)
                stats = sender.send(model.named_parameters(), version=7)
                switch.append(sys.getswitchinterval())
                results.put((0, {"stats": stats, "calls": calls, "digest": digest(model.named_parameters()),
                                 "switch": switch}))
        else:
            with DistReceiver(init, 2, rank, timeout_s=30, label=ENGINE_LABEL) as receiver:
                aborts = []
                for _ in range(2):
                    t0 = time.monotonic()
                    try:
                        receiver.receive()
                        aborts.append(None)
                    except TransportError as e:
                        aborts.append(failure(e, t0))
                before = digest(model.named_parameters())
                calls = count_broadcasts(receiver)
                inner, switch = receiver._receive, [sys.getswitchinterval()]
                receiver._receive = lambda: switch.append(sys.getswitchinterval()) or inner()
                version, tensors = receiver.receive()
                switch.append(sys.getswitchinterval())
                load_weights(model, tensors, strict=True)  # the flat buckets, copied piece by piece
                results.put((1, {"aborted": aborts, "version": version, "received": digest(tensors.items()),
                                 "before": before, "after": digest(model.named_parameters()),
                                 "stats": receiver.last_stats, "calls": calls, "switch": switch}))
    except BaseException as e:
        results.put((rank, failure(e, 0.0)))


@pytest.mark.parametrize("meta_frame", ["fits", "split"])
def test_dist_roundtrip_is_bit_identical_and_bucketed(meta_frame):
    """`split`: metadata frames too small for any bucket's, so each takes its second broadcast."""
    out = run_pair(roundtrip_worker, free_port(), transport_dist.META_BYTES if meta_frame == "fits" else 64)
    assert "error" not in out[0] and "error" not in out[1], out
    sent, got = out[0], out[1]

    # each bad transfer reached the engine as an abort naming the trainer and the reason, and the group survived
    for aborted, version in zip(got["aborted"], (5, 6), strict=True):
        assert aborted is not None and aborted["ranks"] == (0,)
        assert f"rank 0 (trainer) aborted the transfer of version {version}" in aborted["error"]
        assert "given twice" in aborted["error"]

    # bit-identical: what arrived, and the engine's model after load_weights (it started from another seed)
    assert got["version"] == 7
    assert got["received"] == sent["digest"]
    assert got["before"] != sent["digest"]
    assert got["after"] == sent["digest"]
    assert {d.split()[0] for d in sent["digest"].values()} == {"torch.float32", "torch.bfloat16"}

    stats = sent["stats"]
    assert stats.version == 7 and stats.num_tensors == len(sent["digest"]) and stats.seconds > 0
    assert stats.num_bytes == got["stats"].num_bytes > 0
    assert got["stats"].num_buckets == stats.num_buckets and got["stats"].num_tensors == stats.num_tensors
    # they account for the time
    for end, phases in (("sender", ["hello", "flatten", "metadata", "post", "reuse", "land", "done"]),
                        ("receiver", ["hello", "metadata", "post", "land", "ack"])):
        timed = stats if end == "sender" else got["stats"]
        assert list(timed.phases) == phases and min(timed.phases.values()) >= 0, end
        assert sum(timed.phases.values()) == pytest.approx(timed.seconds, rel=0.01, abs=1e-4), end
    print(f"\ngloo weight transfer: {stats.num_bytes / 1e6:.2f} MB, {stats.num_tensors} tensors in "
          f"{stats.num_buckets} buckets, {1e3 * stats.seconds:.1f} ms, {stats.gb_per_s:.3f} GB/s")

    # per bucket, not per tensor: two broadcasts per bucket on each side (three when the metadata is split), and far
    # fewer buckets than tensors
    assert 3 <= stats.num_buckets <= stats.num_tensors // 2
    frames = 1 if meta_frame == "fits" else 2
    expected = {"metadata": frames * stats.num_buckets, "data": stats.num_buckets}
    assert dict(sent["calls"]) == expected and dict(got["calls"]) == expected
    # both ends' threads get the GIL within a short switch interval during the transfer, as before after it
    for end in (sent, got):
        before, during, after = end["switch"]
        assert during == pytest.approx(switch.SWITCH_S) and after == before > during


def test_overlapping_transfers_restore_the_switch_interval_when_the_last_ends():
    """Both ends of a group in one process (or two groups) overlap without nesting: the first to end must not restore
    the interval under the other, the last must restore the one from before."""
    before = sys.getswitchinterval()
    first, second = switch.switching(), switch.switching()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(switch.SWITCH_S)
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == before


def timeout_worker(rank: int, results, ports: list[int], events: list):
    """Phase 1: the engine joins but never receives. Phase 2: the trainer joins but never sends. Phase 3: the
    trainer stalls after bucket 0. Each phase ends when the side that waited has its error (events[phase])."""
    torch.set_num_threads(1)
    out = {}

    def join(phase: int, **kwargs):
        init = f"tcp://127.0.0.1:{ports[phase]}"
        if rank == 0:
            return DistSender(init, 2, timeout_s=TIMEOUT_S, label="trainer", **kwargs)
        return DistReceiver(init, 2, rank, timeout_s=TIMEOUT_S, label=ENGINE_LABEL)

    def attempt(key: str, fn):
        t0 = time.monotonic()
        try:
            fn()
        except TransportError as e:
            out[key] = failure(e, t0)

    def stalled():  # 16-byte buckets: bucket 0 = a goes out once c is produced, then the trainer stalls
        yield from [("a", torch.ones(4)), ("b", torch.ones(4)), ("c", torch.ones(4))]
        events[2].wait(30)

    try:
        if rank == 0:
            with join(0) as sender:
                attempt("no receiver", lambda: sender.send([("w", torch.ones(4))], version=1))
                events[0].set()
            with join(1):
                events[1].wait(30)
            with join(2, bucket_bytes=16) as sender:
                attempt("after the stall", lambda: sender.send(stalled(), version=1))
        else:
            with join(0):
                events[0].wait(30)
            with join(1) as receiver:
                attempt("no sender", receiver.receive)
                with pytest.raises(TransportError, match="failed earlier"):
                    receiver.receive()
                events[1].set()
            with join(2) as receiver:
                attempt("stalled sender", receiver.receive)
                events[2].set()
        results.put((rank, out))
    except BaseException as e:
        results.put((rank, failure(e, 0.0)))


def test_dist_timeouts_name_the_peer():
    ctx = mp.get_context("spawn")
    out = run_pair(timeout_worker, [free_port() for _ in range(3)], [ctx.Event() for _ in range(3)])
    assert "error" not in out[0] and "error" not in out[1], out
    no_receiver, after_stall = out[0]["no receiver"], out[0]["after the stall"]
    no_sender, stalled = out[1]["no sender"], out[1]["stalled sender"]
    for failed in (no_receiver, no_sender, stalled):
        assert f"timeout_s={TIMEOUT_S:g}" in failed["error"]
        assert TIMEOUT_S * 0.9 <= failed["elapsed"] < TIMEOUT_S + 1.5, failed

    assert no_receiver["ranks"] == (1,)
    assert f"rank 1 ({ENGINE_LABEL}) did not start receiving" in no_receiver["error"]
    assert no_sender["ranks"] == (0,)
    assert "handshake with rank 0 (trainer) failed or timed out" in no_sender["error"]
    assert stalled["ranks"] == (0,) and stalled["bucket"] == 1
    assert "metadata of bucket 1 with rank 0 (trainer)" in stalled["error"]
    # the trainer learns at the first operation the closed connection refuses: gloo may still buffer bucket 1's
    assert after_stall["ranks"] == (1,) and after_stall["bucket"] in (1, 2), after_stall


class _NeverLands:
    """A started data broadcast that never completes (a trainer that stopped sending mid-transfer); its own wait
    fails as a backend's does on a timeout."""

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout=None) -> bool:
        raise RuntimeError(f"Timed out after {timeout}")


def data_stall_worker(rank: int, results, port: int):
    """The engine's receive of bucket 0's data never completes; each side reports its error."""
    torch.set_num_threads(1)
    init, out, t0 = f"tcp://127.0.0.1:{port}", {}, time.monotonic()
    try:
        if rank == 0:
            with DistSender(init, 2, timeout_s=TIMEOUT_S, label="trainer") as end:
                t0 = time.monotonic()
                end.send([("w", torch.ones(4))], version=1)
        else:
            with DistReceiver(init, 2, rank, timeout_s=TIMEOUT_S, label=ENGINE_LABEL) as end:
                start = end._start_broadcast
                end._start_broadcast = lambda tensor, group, what, bucket: (
                    _NeverLands() if what == "data" else start(tensor, group, what, bucket))
                t0 = time.monotonic()
                end.receive()
    except TransportError as e:
        out = failure(e, t0)
    except BaseException as e:
        out = {"unexpected": failure(e, t0)}
    results.put((rank, out))


def test_a_bucket_whose_data_never_lands_fails_within_the_timeout_naming_the_trainer():
    """The wait for a bucket's data polls for its completion, and gives up at the timeout."""
    out = run_pair(data_stall_worker, free_port())
    stalled = out[1]
    assert "error" in stalled, out
    assert stalled["ranks"] == (0,) and stalled["bucket"] == 0, stalled
    assert "data of bucket 0 with rank 0 (trainer)" in stalled["error"], stalled
    assert TIMEOUT_S * 0.9 <= stalled["elapsed"] < TIMEOUT_S + 1.5, stalled
    assert "error" in out[0] and out[0]["ranks"] == (1,), out[0]  # the engine never confirmed the transfer


def test_rank_that_never_joins_is_named():
    """World of 3, only ranks 0 and 1 come (threads of this process): both name rank 2 within their timeout.
    Rank 1 gives up first, while rank 0 still hosts the store it asks who is missing."""
    init, errors = f"tcp://127.0.0.1:{free_port()}", {}

    def join(rank):
        t0 = time.monotonic()
        try:
            if rank == 0:
                DistSender(init, 3, timeout_s=1.5)
            else:
                DistReceiver(init, 3, rank, timeout_s=0.5, label=ENGINE_LABEL)
        except TransportError as e:
            errors[rank] = failure(e, t0)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(errors) == [0, 1], errors
    for error in errors.values():
        assert error["ranks"] == (2,) and "rank 2 did not join" in error["error"] and error["elapsed"] < 2.5, error


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="init_method"):
        DistSender("env://", 2)
    with pytest.raises(ValueError, match="world_size"):
        DistSender("tcp://127.0.0.1:1", 1)
    with pytest.raises(ValueError, match="rank"):
        DistReceiver("tcp://127.0.0.1:1", 2, 0)
    with pytest.raises(ValueError, match="bucket_bytes"):
        DistSender("tcp://127.0.0.1:1", 2, bucket_bytes=0)


def test_bucket_meta_survives_its_bytes():
    meta = BucketMeta(0, 5, names=["w"], dtypes=["bfloat16"], shapes=[[2, 3]], offsets=[0], numel=6, is_last=True)
    assert BucketMeta.from_bytes(meta.to_bytes()) == meta


def test_a_receiver_reads_only_buckets_filled_back_to_back():
    """The received tensors are read as pieces of their bucket in order (`FlatTensors`): metadata that places them
    otherwise is refused, not read wrongly."""
    def meta(offsets, numel):
        return BucketMeta(0, 1, names=["a", "b"], dtypes=["float32"] * 2, shapes=[[2, 3], [4]], offsets=offsets,
                          numel=numel)
    assert back_to_back(meta([0, 6], 10))
    for offsets, numel in [([0, 7], 11), ([6, 0], 10), ([0, 6], 12), ([0], 10)]:
        assert not back_to_back(meta(offsets, numel)), (offsets, numel)


def nccl_worker(rank: int, results, port: int):
    torch.cuda.set_device(rank)
    init, model = f"tcp://127.0.0.1:{port}", mixed_model(seed=rank).cuda()
    try:
        if rank == 0:
            with DistSender(init, 2, backend="nccl", timeout_s=60, bucket_bytes=BUCKET_BYTES) as sender:
                stats = sender.send(model.named_parameters(), version=3)
                results.put((0, {"stats": stats, "digest": digest((n, p.cpu()) for n, p in model.named_parameters())}))
        else:
            with DistReceiver(init, 2, rank, backend="nccl", timeout_s=60) as receiver:
                version, tensors = receiver.receive()
                devices = {str(t.device) for t in tensors.values()}
                load_weights(model, tensors, strict=True)  # the flat buckets, copied piece by piece
                results.put((1, {"version": version, "devices": devices,
                                 "after": digest((n, p.cpu()) for n, p in model.named_parameters())}))
    except BaseException as e:
        results.put((rank, failure(e, 0.0)))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_roundtrip_is_bit_identical():
    out = run_pair(nccl_worker, free_port(), timeout_s=120)
    assert "error" not in out[0] and "error" not in out[1], out
    assert out[1]["version"] == 3 and out[1]["devices"] == {"cuda:1"}
    assert out[1]["after"] == out[0]["digest"]
    stats = out[0]["stats"]
    print(f"\nnccl weight transfer: {stats.num_bytes / 1e6:.2f} MB in {stats.num_buckets} buckets, "
          f"{stats.gb_per_s:.3f} GB/s")
