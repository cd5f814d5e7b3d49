"""Weight transport: one contract for the three implementations (in-process, ipc, torch.distributed): delivery
that later changes by the sender cannot reach, bad input refused before anything loads with an abort that reaches
the engine at once, timeouts that name the peer. Then the ipc pair's own (a writer that a frozen reader cannot hold
up, a reader that died) and the engine's end of a sync with its typed reply; torch.distributed's own behaviour is
in test_transport_dist.py."""

import asyncio
import hashlib
import multiprocessing
import queue
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.multiprocessing as mp

from tandem.model.loader import build_model
from tandem.transport.dist import DistReceiver, DistSender
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
