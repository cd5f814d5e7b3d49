"""The transports by reference (in-process, ipc) and what they share: the engine reads the trainer's memory only
inside its load, never after the release, and on a GPU the copy and the trainer's writes are ordered on the device
(no host wait); ipc maps each tensor once and again only when its memory changes. And the weights' checksum, one
host read for all tensors, against its tensor-by-tensor definition."""

import hashlib

import pytest
import torch
import torch.multiprocessing as mp
from test_transport import digest, in_process_pair, in_thread, ipc_pair, mixed_model, run_pair

from tandem.model.loader import WeightLoader, build_model
from tandem.transport.inprocess import InProcessReceiver, InProcessSender
from tandem.transport.ipc import IpcReceiver, IpcSender

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


def test_the_loaders_reused_plan_copies_from_the_new_tensors_and_still_refuses_a_changed_shape():
    """A weight update reuses the last update's checks when names, shapes and dtypes are the same: it must copy
    from the tensors it is given now, and a tensor of another shape is checked again and refused."""
    engine = build_model("tiny", seed=0)
    loader = WeightLoader(engine)
    for seed in (1, 2):
        trainer = build_model("tiny", seed=seed)
        loader.load(dict(trainer.named_parameters()))
        assert digest(engine.named_parameters()) == digest(trainer.named_parameters())
    bad = dict(build_model("tiny", seed=3).named_parameters())
    bad["model.norm.weight"] = bad["model.norm.weight"][:-1]
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        loader.load(bad)
    assert digest(engine.named_parameters()) == digest(trainer.named_parameters())
