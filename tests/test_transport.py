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

from tandem.model.loader import WeightLoader, build_model
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


# ---- by reference in one process: the checks the engine's copy honours -------------------------------------------


def test_a_load_that_starts_after_the_release_is_refused_and_copies_nothing():
    """The sync has ended (released: the trainer may be changing its tensors); a load that only now reaches the
    engine (its caller cancelled, the command ran late) must not read them."""
    model, trainer = build_model("tiny", seed=0), build_model("tiny", seed=1)
    before = digest(model.named_parameters())
    receiver = InProcessReceiver(5.0)
    handover = InProcessSender.offer(trainer.named_parameters())
    receiver.take(1, handover)
    receiver.release()
    with pytest.raises(ValueError, match="released before this load read it"):
        WeightLoader(model).load(handover)
    assert digest(model.named_parameters()) == before
    fresh = InProcessSender.offer(trainer.named_parameters())
    WeightLoader(model).load(fresh)  # an unreleased one loads
    assert digest(model.named_parameters()) == digest(trainer.named_parameters()) and fresh.read


def test_in_process_handover_is_the_senders_memory_not_a_copy():
    trainer = build_model("tiny", seed=1)
    handover = InProcessSender.offer(trainer.named_parameters())
    assert all(handover[n].data_ptr() == p.data_ptr() for n, p in trainer.named_parameters())
    with pytest.raises(ValueError, match="all on one device"):
        InProcessSender.offer([("a", torch.ones(1)), ("b", torch.ones(1, device="meta"))])


# ---- the weights' checksum ----------------------------------------------------------------------------------------


def reference_checksum(named) -> str:
    """The checksum computed tensor by tensor, one host read each (the definition, as first written)."""
    from tandem.transport.checksum import MASK, ROW_WORDS, _odd_weights

    total = 0
    for name, tensor in named:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        words = raw.view(torch.int32) if raw.numel() % 4 == 0 else torch.nn.functional.pad(
            raw, (0, raw.numel() % 2)).view(torch.int16)
        rows = torch.nn.functional.pad(words, (0, -words.numel() % ROW_WORDS)).view(-1, ROW_WORDS)
        cols_sum = (rows.sum(0, dtype=torch.int64) * _odd_weights(ROW_WORDS, rows.device)).sum()
        rows_sum = (rows.sum(1, dtype=torch.int64) * _odd_weights(rows.shape[0], rows.device)).sum()
        tag = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") | 1
        total = (total + (int(cols_sum + rows_sum) & MASK) * tag) & MASK
    return f"{total:016x}"


def checksum_cases(device: str = "cpu") -> list:
    gen = torch.Generator().manual_seed(0)
    named = [(name, p.to(device)) for name, p in mixed_model(seed=2).named_parameters()]
    odd = [(f"odd.{i}", (torch.randn(n, generator=gen) * 1e4).to(dtype).to(device))
           for i, (n, dtype) in enumerate([(1, torch.bfloat16), (3, torch.float16), (7, torch.float32),
                                           (129, torch.bfloat16), (0, torch.float32), (64, torch.int8)])]
    same_shape = [(f"same.{i}", torch.randint(-2**31, 2**31 - 1, (5, 64), generator=gen, dtype=torch.int32).to(device))
                  for i in range(4)]  # large words: the int64 sums wrap, as they must the same way
    return named + odd + same_shape


def test_weights_checksum_equals_the_tensor_by_tensor_definition_in_any_order():
    from tandem.transport.checksum import weights_checksum

    named = checksum_cases()
    value = weights_checksum(named)
    assert value == reference_checksum(named) == weights_checksum(reversed(named))
    changed = [(n, t.clone()) for n, t in named]
    changed[-2][1][4, 63] += 1  # one word of one of several tensors summed together
    assert weights_checksum(changed) != value
    swapped = [*named[:-2], (named[-1][0], named[-2][1]), (named[-2][0], named[-1][1])]  # same bytes, other names
    assert weights_checksum(swapped) != value


@pytest.mark.gpu
def test_weights_checksum_is_the_same_on_a_gpu():
    from tandem.transport.checksum import weights_checksum

    assert weights_checksum(checksum_cases("cuda")) == reference_checksum(checksum_cases())


SLEEP_CYCLES = int(2e8)  # a kernel of about 0.1 s, ahead of the work whose order a test checks


def equal_weights(model, reference) -> bool:
    theirs = dict(reference.named_parameters())
    return all(torch.equal(p, theirs[n]) for n, p in model.named_parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("late", ["the trainer's writes", "the engine's copy"])
def test_in_process_handover_orders_the_copy_after_the_sends_writes_and_before_the_next_on_the_device(late):
    """The engine copies on a stream of its own (as placement colocated has it), and neither side waits on the host.
    The trainer's last writes held up on its stream (a long kernel before them): the copy must still read them. The
    copy held up on the engine's stream: the trainer's writes right after `send` returns must not reach it."""
    device = torch.device("cuda")
    engine_model, trainer = build_model("tiny", seed=0).to(device), build_model("tiny", seed=1).to(device)
    sent = build_model("tiny", seed=2).to(device)
    loader, engine_stream = WeightLoader(engine_model), torch.cuda.Stream(device)
    sender, receiver = in_process_pair(10.0)
    torch.cuda.synchronize()

    def engine():
        _, tensors = receiver.receive()
        with torch.cuda.stream(engine_stream):
            if late == "the engine's copy":
                torch.cuda._sleep(SLEEP_CYCLES)
            loader.load(tensors)
        receiver.release()

    thread = in_thread(engine)
    with torch.no_grad():
        if late == "the trainer's writes":
            torch.cuda._sleep(SLEEP_CYCLES)
        torch._foreach_copy_(list(trainer.parameters()), list(sent.parameters()))  # the trainer's step, last writes
        sender.send(trainer.named_parameters(), 1)
        torch._foreach_add_(list(trainer.parameters()), 1.0)  # the next step
    thread.join(timeout=10)
    torch.cuda.synchronize()
    assert equal_weights(engine_model, sent)


# ---- ipc: mapped once, remapped when the memory changes -----------------------------------------------------------


def test_ipc_maps_each_tensor_once_and_again_only_when_it_is_other_memory():
    """In-place updates travel as names alone (the engine reads the memory it mapped before); a parameter given other
    memory under the same name is mapped again, and the engine reads the new memory, not the old."""
    trainer, engine = build_model("tiny", seed=0), build_model("tiny", seed=5)
    loader, (sender, receiver) = WeightLoader(engine), ipc_pair(10.0)

    def sync(version: int) -> int:
        thread = in_thread(lambda: (loader.load(receiver.receive()[1]), receiver.release()))
        sender.send(trainer.named_parameters(), version)
        thread.join(timeout=10)
        assert digest(engine.named_parameters()) == digest(trainer.named_parameters()), version
        return sender.last_mapped

    with sender, receiver:
        assert sync(1) == len(list(trainer.parameters()))
        with torch.no_grad():
            torch._foreach_add_(list(trainer.parameters()), 1.0)
        assert sync(2) == 0
        norm = trainer.model.norm.weight
        norm.data = norm.data * 3  # other memory; the old stays alive (the sender keeps it until replaced)
        assert sync(3) == 1
        assert sync(4) == 0


def _ipc_gpu_end(rank: int, results, conns, sleep_cycles: int) -> None:
    """Rank 0 the trainer: changes its weights at once after each `send` returns, and before one `send` behind a
    long kernel. Rank 1 the engine: copies on a stream of its own behind a long kernel. Neither waits on the host
    around the transfer; rank 1 reports what it loaded."""
    try:
        device = torch.device("cuda:0")
        if rank == 0:
            trainer = build_model("tiny", seed=1).to(device)
            with IpcSender(conns[0], 30.0, "engine") as sender, torch.no_grad():
                params, mapped = list(trainer.parameters()), []
                sender.send(trainer.named_parameters(), 1)
                mapped.append(sender.last_mapped)
                torch._foreach_add_(params, 1.0)  # the next step, at once
                torch.cuda._sleep(sleep_cycles)
                torch._foreach_mul_(params, 2.0)  # the last writes, held up behind the kernel
                sender.send(trainer.named_parameters(), 2)
                mapped.append(sender.last_mapped)
                torch._foreach_add_(params, 1.0)
                trainer.model.norm.weight.data = trainer.model.norm.weight.data * 3  # other memory
                sender.send(trainer.named_parameters(), 3)
                mapped.append(sender.last_mapped)
                torch.cuda.synchronize()
            results.put((0, mapped))
        else:
            engine, side = build_model("tiny", seed=0).to(device), torch.cuda.Stream(device)
            loader, loaded = WeightLoader(engine), {}
            with IpcReceiver(conns[1], 30.0, "trainer") as receiver:
                for _ in range(3):
                    version, tensors = receiver.receive()
                    with torch.cuda.stream(side):
                        torch.cuda._sleep(sleep_cycles)
                        loader.load(tensors)
                    receiver.release()
                    torch.cuda.synchronize()
                    loaded[version] = digest((n, p.cpu()) for n, p in engine.named_parameters())
            results.put((1, loaded))
    except Exception as e:
        results.put((rank, repr(e)))


@pytest.mark.gpu
def test_ipc_on_one_gpu_orders_the_engines_copy_and_remaps_changed_memory():
    ctx = mp.get_context("spawn")
    out = run_pair(_ipc_gpu_end, ctx.Pipe(), SLEEP_CYCLES, timeout_s=120)
    assert isinstance(out[1], dict), out
    model = build_model("tiny", seed=1)
    expected = {1: digest(model.named_parameters())}
    with torch.no_grad():
        params = list(model.parameters())
        torch._foreach_add_(params, 1.0)
        torch._foreach_mul_(params, 2.0)
        expected[2] = digest(model.named_parameters())
        torch._foreach_add_(params, 1.0)
        model.model.norm.weight.mul_(3)
        expected[3] = digest(model.named_parameters())
    assert out[1] == expected
    assert out[0] == [len(params), 0, 1]
