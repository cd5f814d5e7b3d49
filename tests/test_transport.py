"""Weight transport: one contract for the three implementations (in-process, ipc, torch.distributed): delivery
that later changes by the sender cannot reach, bad input refused before anything loads with an abort that reaches
the engine at once, timeouts that name the peer. Then each one's own: bit-identical delivery in buckets of mixed
dtypes, collectives per bucket (not per tensor) over two real gloo processes; the ipc writer that a frozen reader
cannot hold up, a reader that died; the engine's end of a sync and its typed reply."""

import asyncio
import hashlib
import multiprocessing
import queue
import socket
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.multiprocessing as mp

from tandem.model.loader import build_model, load_weights
from tandem.transport import dist as transport_dist
from tandem.transport.buckets import back_to_back
from tandem.transport.dist import BucketMeta, DistReceiver, DistSender
from tandem.transport.inprocess import InProcessReceiver, InProcessSender
from tandem.transport.ipc import IpcReceiver, IpcSender
from tandem.transport.sync import SyncReply, receive_and_load
from tandem.transport.weights import TransferStats, TransportError

TIMEOUT_S = 2.0
BUCKET_BYTES = 64 << 10  # the tiny model is ~1 MB: several buckets per dtype, the embeddings alone in theirs
ENGINE_LABEL = "engine-0 at 127.0.0.1:30001"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mixed_model(seed: int):
    """The tiny model with its last layer in bf16, so a transfer mixes float32 and bfloat16."""
    model = build_model("tiny", seed=seed)
    model.model.layers[-1].to(torch.bfloat16)
    return model


def digest(named) -> dict[str, str]:
    """name -> dtype, shape and a hash of the raw bytes: equal digests mean bit-identical tensors."""
    return {name: f"{t.dtype} {tuple(t.shape)} "
                  + hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, t in named}


def count_broadcasts(end) -> Counter:
    """Count every broadcast the transport starts, by what it carries."""
    calls, inner = Counter(), end._start_broadcast

    def counted(tensor, group, what, bucket):
        calls[what] += 1
        return inner(tensor, group, what, bucket)

    end._start_broadcast = counted
    return calls


def failure(e: BaseException, t0: float) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "ranks": getattr(e, "ranks", None),
            "bucket": getattr(e, "bucket", None), "elapsed": time.monotonic() - t0}


def run_pair(target, *args, timeout_s: float = 60.0) -> dict[int, dict]:
    """Run target(rank, results, *args) in two spawned processes; return {rank: result}. The children are always
    joined, then terminated, then killed, so a failing test cannot hang the suite."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, results, *args), daemon=True) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        out, deadline = {}, time.monotonic() + timeout_s
        while len(out) < 2:
            try:
                rank, result = results.get(timeout=0.5)
                out[rank] = result
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    pytest.fail(f"no result from rank(s) {dead or [r for r in range(2) if r not in out]}")
        return out
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()


# ---- the contract, over every implementation ----------------------------------------------------------------


def in_process_pair(timeout_s: float):
    receiver = InProcessReceiver(timeout_s)
    return InProcessSender(receiver, timeout_s), receiver


def ipc_pair(timeout_s: float):
    trainer_end, engine_end = multiprocessing.Pipe()
    return IpcSender(trainer_end, timeout_s, ENGINE_LABEL), IpcReceiver(engine_end, timeout_s, "trainer")


def dist_pair(timeout_s: float):
    """Both ends in threads of this process (each constructor waits for the other to join); the sender, which hosts
    the rendezvous store, first."""
    init = f"tcp://127.0.0.1:{free_port()}"
    with ThreadPoolExecutor(1) as pool:
        sender = pool.submit(DistSender, init, 2, timeout_s=timeout_s, bucket_bytes=BUCKET_BYTES, label="trainer")
        time.sleep(0.05)
        receiver = DistReceiver(init, 2, 1, timeout_s=timeout_s, label=ENGINE_LABEL)
        return sender.result(), receiver


# the kind of pair -> (how to make one, how the sender's errors name the receiver, how the receiver's name the sender)
PAIRS = {"in-process": (in_process_pair, "in-process receiver", "in-process sender"),
         "ipc": (ipc_pair, ENGINE_LABEL, "trainer"),
         "dist": (dist_pair, f"rank 1 ({ENGINE_LABEL})", "rank 0 (trainer)")}


def in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("kind", PAIRS)
def test_what_a_receiver_loads_is_what_was_sent_whatever_the_sender_changes_after_send_returns(kind):
    """The engine loads slowly; the trainer's next step changes its tensors in place as soon as `send` returns.
    A transport by reference (ipc) must hold `send` until the receiver released the tensors."""
    model = mixed_model(seed=0)
    sent = digest(model.named_parameters())
    sender, receiver = PAIRS[kind][0](10.0)
    loaded = {}

    def engine():
        version, tensors = receiver.receive()
        time.sleep(0.2)  # loading
        loaded.update(version=version, digest=digest(tensors.items()))
        receiver.release()

    with sender, receiver:
        thread = in_thread(engine)
        stats = sender.send(model.named_parameters(), version=3)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        thread.join(timeout=10)
    assert loaded["version"] == 3 and loaded["digest"] == sent
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for end in (stats, receiver.last_stats):
        assert (end.version, end.num_tensors, end.num_bytes) == (3, len(sent), num_bytes) and end.seconds > 0


@pytest.mark.parametrize("kind", PAIRS)
def test_bad_input_is_refused_and_the_receiver_hears_of_it_at_once(kind):
    """A duplicate name: `send` raises ValueError, and the receiver waiting for that transfer raises naming the
    sender, well before its timeout, having loaded nothing; the next transfer goes through."""
    sender, receiver = PAIRS[kind][0](5.0)
    out = {}

    def engine():
        t0 = time.monotonic()
        try:
            out["received"] = receiver.receive()
        except TransportError as e:
            out["aborted"] = failure(e, t0)

    with sender, receiver:
        thread = in_thread(engine)
        with pytest.raises(ValueError, match="given twice"):
            sender.send([("w", torch.zeros(2)), ("w", torch.zeros(2))], version=5)
        thread.join(timeout=10)
        assert "received" not in out, out
        aborted = out["aborted"]
        assert f"{PAIRS[kind][2]} aborted the transfer of version 5" in aborted["error"], aborted
        assert "given twice" in aborted["error"] and aborted["ranks"] == (0,) and aborted["elapsed"] < 2.5, aborted

        thread = in_thread(lambda: out.update(next=receiver.receive()[0]) or receiver.release())
        sender.send([("w", torch.ones(2))], version=6)
        thread.join(timeout=10)
    assert out["next"] == 6


@pytest.mark.parametrize("kind", PAIRS)
def test_an_end_whose_peer_never_comes_fails_within_its_timeout_naming_the_peer(kind):
    make, receiver_name, sender_name = PAIRS[kind]
    timeout_s, errors = 1.0, {}
    for end in ("sender", "receiver"):
        sender, receiver = make(timeout_s)
        with sender, receiver:
            t0 = time.monotonic()
            try:
                sender.send([("w", torch.ones(2))], version=1) if end == "sender" else receiver.receive()
            except TransportError as e:
                errors[end] = failure(e, t0)
    assert errors["sender"]["ranks"] == (1,) and receiver_name in errors["sender"]["error"], errors
    assert errors["receiver"]["ranks"] == (0,) and sender_name in errors["receiver"]["error"], errors
    for error in errors.values():
        assert f"timeout_s={timeout_s:g}" in error["error"] and timeout_s * 0.9 <= error["elapsed"] < timeout_s + 1.5


# ---- ipc --------------------------------------------------------------------------------------------------------


def test_ipc_sender_is_not_held_up_by_a_receiver_that_never_reads():
    """A transfer bigger than the pipe's buffer blocks its writer until the reader reads; a frozen engine process
    never does. `send` still fails within its timeout, naming it."""
    sender, receiver = ipc_pair(0.5)
    out = {}
    with sender, receiver:
        thread = in_thread(lambda: out.update(error=pytest.raises(TransportError, sender.send,
                                                                  [("x" * (8 << 20), torch.ones(1))], 1)))
        thread.join(timeout=5)
        assert not thread.is_alive(), "send blocked past its timeout"
    assert ENGINE_LABEL in str(out["error"].value) and "did not read weights version 1" in str(out["error"].value)


def test_ipc_sender_learns_at_once_that_the_receiver_went_away_mid_transfer():
    """The engine's process dies while it holds the weights (its end of the pipe closes): no wait for the timeout."""
    sender, receiver = ipc_pair(30.0)
    thread = in_thread(lambda: receiver.receive() and receiver.close())
    t0 = time.monotonic()
    with sender, pytest.raises(TransportError, match=f"{ENGINE_LABEL} closed the connection before it would release"):
        sender.send([("w", torch.ones(2))], version=1)
    thread.join(timeout=5)
    assert time.monotonic() - t0 < 5


def test_ipc_receiver_that_cannot_read_a_transfer_says_so_naming_the_sender():
    """What does not unpickle here (a CUDA IPC handle this process cannot open, say) is a TransportError, not the
    unpickler's own exception ending the engine's process."""
    sender, receiver = ipc_pair(5.0)
    with sender, receiver:
        sender.conn.send_bytes(b"not a pickle")
        with pytest.raises(TransportError, match="could not read what trainer sent: UnpicklingError") as failed:
            receiver.receive()
    assert failed.value.ranks == (0,)


# ---- the engine's end of a sync, and its reply -------------------------------------------------------------------


class _Engine:
    """Stands in for the engine: records loads, or refuses them."""

    def __init__(self, refuse: bool = False):
        self.refuse, self.loads = refuse, []

    async def load_paused(self, named, version, pause_mode) -> float:
        if self.refuse:
            raise ValueError("model.norm.weight: shape mismatch")
        self.loads.append((version, pause_mode, sorted(named)))
        await asyncio.sleep(0.01)  # paused
        return 0.01


@pytest.mark.parametrize("case", ["loads", "wrong version", "refused"])
def test_receive_and_load_loads_only_the_version_asked_for_and_always_releases(case):
    """Over ipc, whose sender waits for the release: a refused or mismatched transfer must still let it go on."""
    sender, receiver = ipc_pair(5.0)
    engine = _Engine(refuse=case == "refused")
    with sender, receiver, ThreadPoolExecutor(1) as pool:
        sent = pool.submit(sender.send, [("w", torch.ones(2))], 4)
        loading = receive_and_load(receiver, engine, 3 if case == "wrong version" else 4, "retract")
        if case == "loads":
            reply = asyncio.run(loading)
        else:
            with pytest.raises(ValueError, match="the request says 3" if case == "wrong version" else "shape"):
                asyncio.run(loading)
        assert sent.result(timeout=5).version == 4  # released
    if case == "loads":
        assert engine.loads == [(4, "retract", ["w"])]
        assert (reply.weight_version, reply.pause_s, reply.num_tensors, reply.num_bytes) == (4, 0.01, 1, 8)
        assert reply.load_s >= reply.pause_s and reply.transfer_s == receiver.last_stats.seconds
    else:
        assert engine.loads == []


def test_sync_reply_is_json_under_its_field_names():
    reply = SyncReply.of(TransferStats(7, 1024, 3, 20, 0.02, phases={"hello": 0.005, "land": 0.015}), 0.004, 0.006)
    data = reply.to_dict()
    assert {"weight_version": 7, "transfer_s": 0.02, "pause_s": 0.004, "load_s": 0.006, "num_buckets": 3}.items() \
        <= data.items()
    assert SyncReply.from_dict({"success": True, "message": "loaded", **data}) == reply
    with pytest.raises(ValueError, match="missing pause_s"):
        SyncReply.from_dict({k: v for k, v in data.items() if k != "pause_s"})


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
        assert during == pytest.approx(transport_dist.SWITCH_S) and after == before > during


def test_overlapping_transfers_restore_the_switch_interval_when_the_last_ends():
    """Both ends of a group in one process (or two groups) overlap without nesting: the first to end must not restore
    the interval under the other, the last must restore the one from before."""
    before = sys.getswitchinterval()
    first, second = transport_dist._switching(), transport_dist._switching()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(transport_dist.SWITCH_S)
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
