"""`tandem plot` (tandem.plot) on a real run's metrics.jsonl: the PNGs written, and every chart drawing exactly the
metrics it names (the values handed to matplotlib, read back from its figures); keys a run lacks skipped and said.
The same run's records logged to Weights & Biases (run.wandb; wandb itself stood in for: no network)."""

import io
import json
import sys

import pytest
from rich.console import Console

from tandem.cli import main as cli_main
from tandem.config import RunConfig
from tandem.plot import CHARTS, METRICS, plot_run
from tandem.run.main import run_with_display
from tandem.run.wandb_log import open_wandb

PNG = b"\x89PNG\r\n\x1a\n"


class WandbStandIn:
    """The calls `tandem.run.wandb_log` makes of wandb, recorded (no account, no network)."""

    def __init__(self):
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def log(self, data, step):
        self.calls.append(("log", data, step))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """A real three-step `tandem run` (in process, as the command runs it, with run.wandb on and wandb a stand-in),
    staleness allowed so that the distribution has spread: its directory and what it logged to wandb."""
    out = tmp_path_factory.mktemp("run")
    wandb = WandbStandIn()
    cfg = RunConfig.load(None, [
        "steps=3", f"out_dir=\"{out}\"", "wandb=true", "wandb_project=\"tests\"", "rollout.group_size=2",
        "rollout.batch_groups=1", "rollout.num_in_flight=6", "rollout.max_staleness=2",
        "random_agent.prompt_len_max=24", "random_agent.response_len_median=4", "random_agent.response_len_max=12",
        "random_agent.turns_max=2"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "wandb", wandb)
        run_with_display(cfg, Console(file=io.StringIO()))
    return out, wandb.calls


@pytest.fixture(scope="module")
def run_dir(logged_run):
    return logged_run[0]


def records_of(run_dir):
    return [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines() if line.strip()]


def lines_of(fig) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].lines}


def test_every_chart_written_with_the_metrics_it_names(run_dir, tmp_path):
    report = plot_run(run_dir, tmp_path)
    assert report.skipped == []
    assert sorted(p.name for p in report.written) == sorted(f"{c.name}.png" for c in CHARTS)
    for path in report.written:
        assert path.read_bytes()[:8] == PNG and path.stat().st_size > 5000
    records = records_of(run_dir)
    steps = [r["step"] for r in records]
    assert steps == [1, 2, 3]

    def column(key, scale=1.0):
        return steps, [r[key] * scale for r in records]

    figures = report.figures
    assert lines_of(figures["reward"]) == {"mean": column("reward_mean")}
    band = figures["reward"].axes[0].collections[0].get_paths()[0].vertices[:, 1].tolist()
    for r in records:
        assert any(abs(y - (r["reward_mean"] + r["reward_std"])) < 1e-12 for y in band)
        assert any(abs(y - (r["reward_mean"] - r["reward_std"])) < 1e-12 for y in band)
    assert lines_of(figures["staleness"]) == {"mean": column("staleness_mean"), "max": column("staleness_max")}
    assert lines_of(figures["throughput"]) == {"trained": column("trained_tokens_per_s"),
                                               "generated": column("rollout_tokens_per_s")}
    assert lines_of(figures["idle"]) == {"trainer": column("trainer_idle_frac", 100.0),
                                         "engine": column("engine_idle_frac", 100.0)}
    assert lines_of(figures["weight_sync"]) == {"weight sync (total)": column("sync_s", 1e3),
                                                "transfer": column("transfer_s", 1e3),
                                                "generation paused": column("pause_s", 1e3)}
    assert lines_of(figures["mismatch"]) == {"KL": column("mismatch_kl"), "k3 estimate": column("mismatch_k3")}
    # the distribution: trained tokens at each staleness, summed over the run's steps
    width = max(len(r["staleness_tokens"]) for r in records)
    totals = [sum(r["staleness_tokens"][i] for r in records if i < len(r["staleness_tokens"])) for i in range(width)]
    assert [bar.get_height() for bar in figures["staleness_distribution"].axes[0].patches] == totals
    assert sum(totals) == sum(r["tokens_trained"] for r in records)


def test_keys_a_run_lacks_are_skipped_and_said(run_dir, tmp_path):
    records = records_of(run_dir)
    for r in records:
        for key in ("trainer_idle_frac", "engine_idle_frac", "mismatch_k3"):
            del r[key]
    records[1]["mismatch_kl"] = None  # a step that reported no value is no point
    records.append(dict(records[0], transfer_s=9.0))  # a step written twice (a resumed run): the last one counts
    (tmp_path / METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))
    report = plot_run(tmp_path)
    assert report.skipped == ["idle.png: no record of the run has trainer_idle_frac or engine_idle_frac",
                              "mismatch_k3 in mismatch.png: no record of the run has it"]
    assert not (tmp_path / "plots" / "idle.png").exists() and (tmp_path / "plots" / "mismatch.png").is_file()
    assert lines_of(report.figures["mismatch"]) == {"KL": ([1, 3], [records[0]["mismatch_kl"],
                                                                    records[2]["mismatch_kl"]])}
    assert lines_of(report.figures["weight_sync"])["transfer"][1][0] == 9000.0


def test_cli_writes_and_refuses(run_dir, tmp_path, capsys):
    cli_main(["plot", str(run_dir), "--out", str(tmp_path / "charts")])
    assert f"wrote {tmp_path / 'charts' / 'reward.png'}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli_main(["plot", str(tmp_path)])
    assert exit_.value.code == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / METRICS).write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match="metrics.jsonl line 2 is not a step record"):
        plot_run(tmp_path)


def test_without_matplotlib_a_clear_message(run_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (an import of it then raises ImportError)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ValueError, match=r"needs matplotlib.*pip install 'tandem-rl\[plot\]'"):
        plot_run(run_dir)


def test_wandb_gets_every_step_record_numbers(logged_run):
    run_dir, calls = logged_run
    (_, init), *logs, finish = calls
    assert init["project"] == "tests" and init["dir"] == str(run_dir) and init["config"]["steps"] == 3
    assert finish == ("finish",)
    records = records_of(run_dir)
    assert [step for _, _, step in logs] == [1, 2, 3]
    for (_, data, _), record in zip(logs, records, strict=True):
        assert data == {k: v for k, v in record.items() if type(v) in (int, float)}
        assert "reward_mean" in data and "staleness_tokens" not in data and "dropped" not in data


def test_wandb_not_installed_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert open_wandb(RunConfig()) is None  # (off by default: never imported)
    with pytest.raises(ValueError, match=r"run.wandb: needs the wandb package \(pip install 'tandem-rl\[wandb\]'\)"):
        open_wandb(RunConfig(wandb=True))
