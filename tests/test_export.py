"""`tandem export` and `trainer.export_every` (tandem.run.export): a run's policy as a Hugging Face checkpoint that
transformers loads with tandem's logits, with the run's tokenizer, and that tandem itself serves."""

import asyncio
import dataclasses
import io
import json

import pytest
import torch
import transformers
from rich.console import Console
from safetensors.torch import load_file

from tandem.cli import main as cli_main
from tandem.config import PRESETS, RunConfig
from tandem.engine.engine import Engine
from tandem.model.attention import PackedCausal
from tandem.model.loader import build_model
from tandem.run.export import CHECKPOINT, export_run, hf_tensors, parse_size
from tandem.run.main import run_with_display
from tandem.tokenizer import load_tokenizer, train_tokenizer
from tandem.trainer.trainer import Trainer
from tandem.types import SamplingParams

SHORT_RUN = ["steps=2", "rollout.group_size=2", "rollout.batch_groups=1", "rollout.num_in_flight=4",
             "random_agent.prompt_len_max=24", "random_agent.response_len_median=4", "random_agent.response_len_max=12",
             "random_agent.turns_max=2", "trainer.lr=1e-2"]


def model_dir(path, preset: str, tokenizer: bool = True):
    """A model directory as users bring one: a config.json (no weights: random) and maybe a tokenizer. "tiny-tied":
    tiny with its head tied to the embedding."""
    path.mkdir(parents=True)
    config = PRESETS["tiny"].with_(tie_word_embeddings=True) if preset == "tiny-tied" else PRESETS[preset]
    (path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    if tokenizer:
        train_tokenizer(path, vocab_size=400)
    return str(path)


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    """A real `tandem run` (in process, as the command runs it) of two steps, exporting at every step."""
    root = tmp_path_factory.mktemp("dense")
    cfg = RunConfig.load(None, [*SHORT_RUN, f"model=\"{model_dir(root / 'model', 'tiny')}\"",
                                f"out_dir=\"{root / 'run'}\"", "trainer.export_every=1"])
    run_with_display(cfg, Console(file=io.StringIO()))
    return root / "run"


def checkpoint_dir(path, preset: str, param_dtype: str = "float32"):
    """A run directory holding what a run's checkpoint holds for the trainer (its master weights and version), of a
    trainer whose weights were all perturbed (norms off one, routers away from uniform: no mix-up can hide)."""
    cfg = RunConfig.load(None, [f"model=\"{model_dir(path / 'model', preset, tokenizer=False)}\"",
                                f"out_dir=\"{path / 'run'}\"", f"trainer.param_dtype=\"{param_dtype}\""])
    trainer = Trainer(build_model(cfg.model, dtype="float32", seed=3), cfg.trainer, cfg.loss)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in trainer.master.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    trainer.version = 7
    run = path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    torch.save({"trainer": trainer.state_dict(), "manager": {}, "rng": {}}, run / CHECKPOINT)
    return run


def tandem_logits(state: dict, model: str, ids: torch.Tensor) -> torch.Tensor:
    ours = build_model(model, dtype="float32")
    ours.load_state_dict(state)
    with torch.no_grad():
        return ours.compute_logits(ours(ids, torch.arange(len(ids)), PackedCausal([len(ids)])))


def hf_logits(out_dir, ids: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


def trained_state(run_dir) -> dict:
    return torch.load(run_dir / CHECKPOINT, weights_only=True)["trainer"]["model"]


def assert_close(a, b, tol=1e-5):
    assert ((a - b).abs().max() / b.abs().max()).item() < tol


def test_dense_run_exports_what_transformers_and_tandem_load_with_equal_logits(dense_run, tmp_path, capsys):
    out = tmp_path / "hf"
    cli_main(["export", str(dense_run), str(out)])
    printed = capsys.readouterr().out
    assert f"{dense_run / CHECKPOINT}" in printed and "step 2" in printed and "float32" in printed
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    state = trained_state(dense_run)
    model = json.loads((dense_run / "config.json").read_text())["model"]
    ids = torch.randint(0, 400, (13,), generator=torch.Generator().manual_seed(0))
    expected = tandem_logits(state, model, ids)
    assert not torch.equal(expected, tandem_logits(build_model(model, seed=0).state_dict(), model, ids))  # trained
    assert_close(hf_logits(out, ids), expected)
    # the tokenizer comes along, saved by transformers, and loads as the run's did
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.get_vocab() == load_tokenizer(model).get_vocab()
    assert tokenizer.chat_template == load_tokenizer(model).chat_template
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation.do_sample and generation.temperature == 1.0 and generation.eos_token_id == 1
    # the run's own export of its last step holds the same weights
    own = dense_run / "exports" / "step_000002"
    assert sorted(p.name for p in (dense_run / "exports").iterdir()) == ["step_000001", "step_000002"]
    assert load_file(own / "model.safetensors").keys() == load_file(out / "model.safetensors").keys()
    for name, tensor in load_file(own / "model.safetensors").items():
        assert torch.equal(tensor, load_file(out / "model.safetensors")[name]), name


def test_tandem_serves_the_export(dense_run, tmp_path):
    out = tmp_path / "hf"
    export_run(dense_run, out)
    state = trained_state(dense_run)
    model = json.loads((dense_run / "config.json").read_text())["model"]
    ids = torch.randint(0, 400, (9,), generator=torch.Generator().manual_seed(1))
    with Engine(str(out)) as engine:
        assert engine.tokenizer is not None
        with torch.no_grad():
            served = engine.model.compute_logits(engine.model(ids, torch.arange(9), PackedCausal([9])))
        assert_close(served, tandem_logits(state, model, ids))
        output = asyncio.run(engine.generate(ids.tolist(), SamplingParams(max_new_tokens=4, seed=5, ignore_eos=True)))
    # what it sampled, at the logprobs transformers gives the same tokens
    full = torch.tensor(ids.tolist() + output.output_ids)
    logprobs_TV = torch.log_softmax(hf_logits(out, full), -1)[len(ids) - 1:-1]
    ref = logprobs_TV.gather(-1, torch.tensor(output.output_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(output.output_logprobs), ref, atol=1e-4)


def test_moe_export_sharded_loads_in_transformers_with_equal_logits(tmp_path):
    run = checkpoint_dir(tmp_path, "tiny-moe")
    out = tmp_path / "hf"
    exported = export_run(run, out, max_shard_bytes=60_000)
    assert exported.version == 7 and exported.dtype == "float32" and "preset" not in exported.no_tokenizer
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((out / s).is_file() for s in shards)
    # experts one tensor per expert, as Hugging Face checkpoints store them
    assert "model.layers.1.mlp.experts.5.up_proj.weight" in index["weight_map"]
    assert not any(name.endswith("gate_up_proj") for name in index["weight_map"])
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.randint(0, 512, (11,), generator=torch.Generator().manual_seed(2))
    model = json.loads((run / "config.json").read_text())["model"]
    expected = tandem_logits(trained_state(run), model, ids)
    assert_close(hf_logits(out, ids), expected)
    served = build_model(str(out), dtype="float32")  # (Engine builds its model so: see the dense test)
    with torch.no_grad():
        assert_close(served.compute_logits(served(ids, torch.arange(11), PackedCausal([11]))), expected)


def test_dtype_is_the_trained_one_unless_asked_and_a_tied_head_is_written_once(tmp_path):
    run = checkpoint_dir(tmp_path, "tiny-tied", param_dtype="bfloat16")
    export_run(run, tmp_path / "bf16")
    weights = load_file(tmp_path / "bf16" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16} and "lm_head.weight" not in weights
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    cli_main(["export", str(run), str(tmp_path / "fp32"), "--dtype", "float32", "--max-shard-size", "20MB"])
    weights = load_file(tmp_path / "fp32" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}
    state = trained_state(run)
    assert torch.equal(weights["model.norm.weight"], state["model.norm.weight"])
    ids = torch.randint(0, 512, (10,), generator=torch.Generator().manual_seed(3))
    model = json.loads((run / "config.json").read_text())["model"]
    assert_close(hf_logits(tmp_path / "fp32", ids), tandem_logits(state, model, ids))
    assert parse_size("5GB") == 5 * 10**9 and parse_size("64kb") == 64_000 and parse_size("123") == 123
    with pytest.raises(ValueError, match="max shard size '5 parsecs'"):
        parse_size("5 parsecs")


def test_refuses_a_run_without_what_it_needs(tmp_path, capsys):
    with pytest.raises(ValueError, match="is not a directory"):
        export_run(tmp_path / "nowhere", tmp_path / "out")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(dataclasses.asdict(RunConfig())))
    (empty / "checkpoint.pt.tmp").write_bytes(b"half")
    with pytest.raises(SystemExit) as exit_:
        cli_main(["export", str(empty), str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert "has no checkpoint.pt (only an unfinished save, checkpoint.pt.tmp)" in capsys.readouterr().err
    (empty / "config.json").unlink()
    (empty / "checkpoint.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match="has no config.json"):
        export_run(empty, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refuses_a_missing_or_corrupted_tensor_and_writes_nothing(tmp_path):
    run = checkpoint_dir(tmp_path, "tiny-moe")
    good = torch.load(run / CHECKPOINT, weights_only=True)
    config = PRESETS["tiny-moe"]
    hf_tensors(good["trainer"]["model"], config)  # (the unharmed state passes)

    def save_with(change):
        state = {k: v.clone() for k, v in good["trainer"]["model"].items()}
        change(state)
        torch.save({**good, "trainer": {**good["trainer"], "model": state}}, run / CHECKPOINT)

    cases = [
        (lambda s: s.pop("model.layers.2.mlp.experts.down_proj"), "lacks 1 tensor.*layers.2.mlp.experts.down_proj"),
        (lambda s: s.__setitem__("model.norm.weight", torch.ones(3)), r"model.norm.weight has shape \(3,\)"),
        (lambda s: s["model.layers.0.self_attn.q_proj.weight"].view(-1)[5].fill_(float("nan")),
         "q_proj.weight holds NaN or infinite values"),
        (lambda s: s.__setitem__("model.extra.weight", torch.zeros(2)), "tensors the model does not have"),
    ]
    for change, message in cases:
        save_with(change)
        with pytest.raises(ValueError, match=message):
            export_run(run, tmp_path / "out")
        assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
    (run / CHECKPOINT).write_bytes((run / CHECKPOINT).read_bytes()[:1000])  # a truncated file
    with pytest.raises(ValueError, match="cannot read .*checkpoint.pt"):
        export_run(run, tmp_path / "out")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        export_run(run, tmp_path / "out")
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"
