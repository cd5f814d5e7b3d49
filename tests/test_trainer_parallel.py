"""The trainer's memory and parallelism options against the plain single-process trainer: activation checkpointing
(same gradients), bf16 compute with float32 masters (it trains; dtypes where they belong), and FSDP2 over 2 gloo
ranks (the same step as one process, and a falsifier for the global token normalisation)."""

import datetime
import io
import queue
import random
import shutil
import socket
import time

import pytest
import torch
import torch.distributed as dist
from test_tp import rank_processes
from torch.distributed.tensor import Shard, distribute_tensor

from tandem.config import LossConfig, TrainerConfig
from tandem.distributed import collectives
from tandem.model.loader import build_model
from tandem.model.qwen3 import attention_inputs
from tandem.trainer import parallel
from tandem.trainer.trainer import Trainer
from tandem.types import Episode, Group

MICRO = 48  # tokens per micro-batch: several per rank, and not the same number on both ranks


def make_groups(seed=0, num_groups=3, group_size=3, vocab=512) -> list[Group]:
    """Multi-turn episodes: prompt, response, tool output, response; behaviour logprobs near a random model's."""
    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        episodes = []
        for j in range(group_size):
            e = Episode(f"{g}-{j}", g, reward=rng.uniform(-1, 1))
            for turn, policy in enumerate((False, True, False, True)):
                n = rng.randint(2, 12) if turn else rng.randint(4, 10)
                e.add([rng.randrange(vocab) for _ in range(n)], policy,
                      [rng.uniform(-7.0, -5.5) for _ in range(n)] if policy else None, [0] * n if policy else None)
            episodes.append(e)
        groups.append(Group(g, episodes, 0))
    return groups


def make_trainer(seed=0, **cfg) -> Trainer:
    return Trainer(build_model("tiny", dtype="float32", seed=seed), TrainerConfig(micro_batch_tokens=MICRO, **cfg),
                   LossConfig())


def saved(state: dict) -> dict:
    """`state` written and read back, as a checkpoint is (a trainer's state dict holds its live tensors)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in trainer.named_weights()}


def batch_gradients(trainer: Trainer, groups: list[Group]) -> dict[str, torch.Tensor]:
    episodes = [e for g in groups for e in g.episodes]
    trainer._backward(episodes, [e.reward for e in episodes], sum(e.num_policy_tokens for e in episodes))
    return {name: p.grad.clone() for name, p in trainer.master.named_parameters()}


def test_activation_checkpointing_gives_the_same_gradients():
    groups = make_groups()
    calls = {True: 0, False: 0}
    for on in (False, True):
        trainer = make_trainer(activation_checkpointing=on)
        # a pre-hook: the recomputation stops early, once it has every saved tensor, so after-hooks may not run
        trainer.model.model.layers[0].mlp.register_forward_pre_hook(
            lambda *_, on=on: calls.__setitem__(on, calls[on] + 1))
        batch_gradients(trainer, groups)
    assert calls == {False: 1, True: 2}, "checkpointing should run each layer's forward again in the backward"
    # One model for both: two copies of the same weights at other addresses already differ in the last bits (the
    # CPU matmul kernels' results depend on alignment).
    trainer = make_trainer()
    expected = batch_gradients(trainer, groups)
    trainer.optimizer.zero_grad(set_to_none=True)
    parallel.checkpoint_layers(trainer.model)
    for name, g in batch_gradients(trainer, groups).items():
        torch.testing.assert_close(g, expected[name], rtol=1e-6, atol=1e-9, msg=name)


def test_bf16_compute_with_float32_masters_trains():
    groups = make_groups()
    trainer = make_trainer(param_dtype="bfloat16", lr=1e-2)
    losses = [trainer.step(groups)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0] - 0.5, losses  # about 0.2 to -1.2, as in float32
    assert all(p.dtype == torch.float32 for p in trainer.master.parameters())
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    states = list(trainer.optimizer.state.values())
    assert len(states) == len(list(trainer.master.parameters()))  # AdamW steps the masters, not the bf16 weights
    assert all(s[k].dtype == torch.float32 for s in states for k in ("exp_avg", "exp_avg_sq"))
    # the bf16 weights are the masters, rounded, and they are what the engine gets
    for (name, w), (_, master) in zip(trainer.named_weights(), trainer.master.named_parameters(), strict=True):
        assert w.dtype == torch.bfloat16 and torch.equal(w, master.to(torch.bfloat16)), name
    state = saved(trainer.state_dict())
    assert all(t.dtype == torch.float32 for t in state["model"].values())
    restored = make_trainer(seed=1, param_dtype="bfloat16", lr=1e-2)
    restored.load_state_dict(state)
    for (name, w), (_, w2) in zip(trainer.named_weights(), restored.named_weights(), strict=True):
        assert torch.equal(w, w2), name
    assert restored.step(groups)["loss"] == trainer.step(groups)["loss"]
    assert_weights_close(weights(restored), weights(trainer), rtol=0, atol=0)  # the optimizer state came back too


def test_logits_only_for_policy_tokens_give_the_loss_over_every_row():
    """The trainer computes logits only for the rows of policy tokens; the loss and its metrics equal the loss
    function's over every row with the environment tokens masked out."""
    from tandem.model.attention import PackedCausal
    from tandem.trainer.losses import LossInput, get_loss

    groups = make_groups(seed=4)
    trainer = make_trainer()
    episodes = [e for g in groups for e in g.episodes]
    advantages = [e.reward for e in episodes]
    total = sum(e.num_policy_tokens for e in episodes)
    n, metrics = trainer._backward(episodes, advantages, total)
    assert n == total
    lens = [len(e.tokens) for e in episodes]
    ids = torch.tensor([t for e in episodes for t in e.tokens])
    with torch.no_grad():
        logprobs_TV = torch.log_softmax(trainer.model.compute_logits(trainer.model(
            ids, torch.cat([torch.arange(k) for k in lens]), PackedCausal(lens))), -1)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    # row r's logits predict token r + 1: every token but each episode's first
    rows = torch.cat([torch.arange(s, s + k - 1) for s, k in zip(starts, lens, strict=True)])
    logprobs = logprobs_TV[rows, ids[rows + 1]]
    flat = lambda values: torch.tensor([v for e in values for v in e], dtype=torch.float32)  # noqa: E731
    inp = LossInput(logprobs=logprobs, old_logprobs=logprobs, loss_mask=flat([e.loss_mask[1:] for e in episodes]),
                    behav_logprobs=flat([e.behav_logprobs[1:] for e in episodes]),
                    advantages=flat([[a] * (len(e.tokens) - 1) for e, a in zip(episodes, advantages, strict=True)]))
    _, expected = get_loss(trainer.cfg.loss)(inp, trainer.loss_cfg)
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_compiled_layers_capture_one_graph_per_region_for_every_layer_and_length():
    """`compile_layers`: dynamo captures each region around attention once (dynamic shapes: no recompilation for
    another layer or another batch's length), and the captured graphs give the eager model's gradients."""
    graphs = []

    def backend(gm, example_inputs):  # records what dynamo captured, runs it as captured
        graphs.append(gm)
        return gm.forward

    def gradients(seed):
        trainer.optimizer.zero_grad(set_to_none=True)
        return batch_gradients(trainer, make_groups(seed))

    trainer = make_trainer()
    expected = [gradients(seed) for seed in range(3)]
    trainer.model.compile_layers(backend)
    for seed in range(3):  # three batches of different lengths
        got = gradients(seed)
        for name, g in got.items():
            torch.testing.assert_close(g, expected[seed][name], rtol=1e-5, atol=1e-7)
        assert len(graphs) == 2, f"batch {seed}: {len(graphs)} graphs captured, expected the two regions once"


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on a CPU needs a C++ compiler")
def test_layers_compiled_by_inductor_give_the_eager_gradients():
    trainer = make_trainer()
    expected = batch_gradients(trainer, make_groups())
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.model.compile_layers("inductor")
    for name, g in batch_gradients(trainer, make_groups()).items():
        torch.testing.assert_close(g, expected[name], rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


ON_CUDA = {  # option -> (its config with it off and on, whether a trainer's model really uses it)
    "compile": (lambda on: dict(compile=on, fused_kernels=False),
                lambda model: model.model.layers[0].regions[0] is not attention_inputs),
    "fused_kernels": (lambda on: dict(compile=False, fused_kernels=on),
                      lambda model: model.model.norm.kernel is not None),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("option", list(ON_CUDA))
def test_the_trainers_cuda_options_give_the_pytorch_gradients(option, dtype):
    """On CUDA the trainer compiles its layers (inductor; the default), or runs its norms, RoPE and
    SiLU-and-multiply through fused Triton kernels with their own backward passes; either way the batch's gradients
    equal the eager PyTorch ops' (bf16: within a few roundings)."""
    config, used = ON_CUDA[option]
    groups = make_groups()
    grads = {}
    for on in (False, True):
        trainer = Trainer(build_model("tiny", dtype="float32", seed=0).cuda(),
                          TrainerConfig(micro_batch_tokens=MICRO, param_dtype=dtype, **config(on)), LossConfig())
        assert used(trainer.model) == on
        grads[on] = batch_gradients(trainer, groups)
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == "float32" else dict(rtol=0.1, atol=2e-3)
    for name, g in grads[True].items():
        torch.testing.assert_close(g, grads[False][name], **tol, msg=lambda m, name=name: f"{name}: {m}")


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="trainer.param_dtype"):
        TrainerConfig(param_dtype="float16")
    with pytest.raises(ValueError, match="trainer.fsdp"):
        TrainerConfig(fsdp=1)
    with pytest.raises(ValueError, match="trainer.fsdp"):
        make_trainer(fsdp=True)  # no process group


def _fsdp_rank(rank, world, port, groups, out_dir, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    out = {}
    trainer = make_trainer(fsdp=True, activation_checkpointing=True)
    out["metrics"] = trainer.step(groups)
    out["weights"] = weights(trainer)  # full tensors on every rank
    state = saved(trainer.state_dict())
    out["state_model"] = state["model"]
    restored = make_trainer(seed=1, fsdp=True)
    restored.load_state_dict(state)
    out["restored"] = weights(restored)
    trainer.step(groups)
    restored.step(groups)  # the optimizer state came back too
    out["second"], out["restored_second"] = weights(trainer), weights(restored)

    # Falsifier: each rank normalises by its own policy tokens times the world size, i.e. the ranks' gradients are
    # per-rank token means, averaged over ranks (what FSDP's default reduction would make of per-rank means).
    real = parallel.sync_batch
    parallel.sync_batch = lambda local, *args: (local * world, real(local, *args)[1])
    falsified = make_trainer(fsdp=True)
    falsified.step(groups)
    out["per_rank_mean"] = weights(falsified)
    parallel.sync_batch = real

    out["gathered"] = gathered_checks(trainer)

    mixed = make_trainer(fsdp=True, param_dtype="bfloat16")
    out["bf16_loss"] = mixed.step(groups)["loss"]
    out["bf16_dtypes"] = ({p.dtype for p in mixed.master.parameters()}, {t.dtype for _, t in mixed.named_weights()},
                          {s["exp_avg"].dtype for s in mixed.optimizer.state.values()})
    torch.save(out, out_dir / f"rank{rank}.pt")  # not through the queue: it would share tensors by file descriptor
    dist.destroy_process_group()
    results.put(rank)


def gathered_checks(trainer: Trainer) -> list[tuple[int, bool]]:
    """`parallel.gathered` over the trainer's parameters and three of dim 0 that 2 ranks cannot split evenly (one
    rank holds nothing of the last), at three bucket sizes: (all-gathers made, each tensor bit for bit its
    `full_tensor()`) per size."""
    mesh = next(trainer.model.parameters()).device_mesh
    rng = torch.Generator().manual_seed(0)  # (the same tensors on every rank, as `distribute_tensor` needs)
    odd = [(f"odd{n}", distribute_tensor(torch.randn(n, 3, generator=rng), mesh, [Shard(0)])) for n in (7, 3, 1)]
    named = [*trainer.model.named_parameters(), *odd]
    expected = {name: p.detach().to(torch.bfloat16).full_tensor() for name, p in named}
    recorder, checks = collectives.get_recorder(), []
    for bucket_bytes in (1, 4096, 1 << 30):
        first = recorder.entries()[-1]["record_id"] + 1 if recorder.entries() else 0
        got = list(parallel.gathered(named, torch.bfloat16, bucket_bytes))
        gathers = [e for e in recorder.entries() if e["record_id"] >= first]
        assert all(e["profiling_name"] == "gloo:all_gather_single" for e in gathers), gathers
        checks.append((len(gathers), [n for n, _ in got] == list(expected)
                       and all(torch.equal(t, expected[n]) for n, t in got)))
    return checks


def run_fsdp(world, groups, out_dir, timeout=120) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = rank_processes()
    results = ctx.Queue()
    procs = [ctx.Process(target=_fsdp_rank, args=(r, world, port, groups, out_dir, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        done, deadline = 0, time.monotonic() + timeout
        while done < world:
            try:
                results.get(timeout=1)
                done += 1
            except queue.Empty:
                if any(p.exitcode for p in procs) or time.monotonic() > deadline:
                    raise AssertionError(f"FSDP at {world} ranks failed or gave no result within {timeout} s "
                                         f"(exit codes {[p.exitcode for p in procs]})") from None
        return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


def assert_weights_close(got, expected, **tol):
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        torch.testing.assert_close(got[name], t, msg=name, **tol)


@pytest.mark.slow
def test_fsdp_step_equals_single_process_step(tmp_path):
    groups = make_groups()
    episodes = [e for g in groups for e in g.episodes]
    single = make_trainer()
    shares = parallel.split_episodes([len(e.tokens) for e in episodes], 2)
    tokens = [sum(sum(episodes[i].loss_mask[1:]) for i in share) for share in shares]
    num_micro = [len(single._micro_batches([episodes[i] for i in share])) for share in shares]
    # the premises: a per-rank token mean would weigh tokens unequally, and one rank runs a padding micro-batch
    assert tokens[0] != tokens[1] and num_micro[0] != num_micro[1], (tokens, num_micro)

    ranks = run_fsdp(2, groups, tmp_path)
    expected = single.step(groups)
    expected_weights = weights(single)
    tol = dict(rtol=1e-5, atol=1e-6)
    for out in ranks:
        got = out["metrics"]
        assert got.keys() == expected.keys()
        for key in expected.keys() - {"ess"}:  # ess is averaged over micro-batches, so it depends on the packing
            assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
        assert_weights_close(out["weights"], expected_weights, **tol)
        assert_weights_close(out["restored"], out["weights"], rtol=0, atol=0)
        assert_weights_close(out["restored_second"], out["second"], rtol=0, atol=0)
        assert out["bf16_dtypes"] == ({torch.float32}, {torch.bfloat16}, {torch.float32})
        # a parameter a bucket, some to a bucket, all in one: the same tensors, with that many all-gathers
        (one, each), (some, ok), (whole, all_ok) = out["gathered"]
        assert each and ok and all_ok and one == len(expected_weights) + 3 and 1 < some < one and whole == 1
        assert out["bf16_loss"] == pytest.approx(expected["loss"], rel=0.05)
    assert_weights_close(ranks[0]["state_model"], single.state_dict()["model"], **tol)
    assert ranks[1]["state_model"] == {}  # the full state is gathered on rank 0 only

    # Without the global normalisation the step is a different one: about 2 x lr here (AdamW's first step is about
    # lr x sign(gradient)), against < 1e-6 with it.
    diff = max((ranks[0]["per_rank_mean"][k] - expected_weights[k]).abs().max().item() for k in expected_weights)
    assert diff > 1e-4, diff
