"""`tandem plot RUN_DIR`: PNG charts of a run's `metrics.jsonl` (one record per trainer step, `tandem.run.loop`),
drawn with matplotlib, an optional dependency (`pip install 'tandem-rl[plot]'`).

Each chart is declared once in `CHARTS`: the record keys it draws against the step. A key that no record of the run
holds (an older run, a metric a setup does not report) is left out of its chart and reported; a chart with none of
its keys is not written. `chart_data` is exactly what a chart hands matplotlib.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

METRICS = "metrics.jsonl"  # (the name `tandem.run.loop` writes)


@dataclasses.dataclass(frozen=True, slots=True)
class Line:
    """A record key drawn against the step, its values times `scale`; `band`: a key whose values (times `scale`)
    shade the line's value plus and minus them."""

    key: str
    label: str
    scale: float = 1.0
    band: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Chart:
    """`lines` drawn against the step, or with `histogram` the element-wise sum over all steps of that key's lists
    (bar i: the total at index i)."""

    name: str  # the file's stem
    title: str
    ylabel: str
    lines: tuple[Line, ...] = ()
    histogram: str | None = None
    xlabel: str = "trainer step"


CHARTS = (
    Chart("reward", "Reward", "reward (batch mean, ±1 std)", (Line("reward_mean", "mean", band="reward_std"),)),
    Chart("staleness", "Staleness of trained tokens", "versions behind the trainer",
          (Line("staleness_mean", "mean"), Line("staleness_max", "max"))),
    Chart("staleness_distribution", "Staleness distribution (whole run)", "trained tokens",
          histogram="staleness_tokens", xlabel="staleness (versions)"),
    Chart("throughput", "Throughput", "tokens / s (since the start)",
          (Line("trained_tokens_per_s", "trained"), Line("rollout_tokens_per_s", "generated"))),
    Chart("idle", "Idle time", "% of wall time (since the start)",
          (Line("trainer_idle_frac", "trainer", 100.0), Line("engine_idle_frac", "engine", 100.0))),
    Chart("weight_sync", "Weight sync", "ms per step",
          (Line("sync_s", "weight sync (total)", 1e3), Line("transfer_s", "transfer", 1e3),
           Line("pause_s", "generation paused", 1e3))),
    Chart("mismatch", "Trainer-engine mismatch", "KL (engine || trainer)",
          (Line("mismatch_kl", "KL"), Line("mismatch_k3", "k3 estimate"))),
)


@dataclasses.dataclass(slots=True)
class PlotReport:
    """`written`: the PNG files; `skipped`: one line per key or chart left out, saying why; `figures`: the
    matplotlib figures by chart name."""

    written: list[Path] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    figures: dict = dataclasses.field(default_factory=dict)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The run's records in step order, one per step (the last written, should a step appear twice). ValueError
    naming the file when it is missing, empty or not JSON lines."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise ValueError(f"{str(run_dir)!r} has no {METRICS} (a run appends a record to it every step)")
    by_step: dict[int, dict] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            by_step[int(record["step"])] = record
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path} line {number} is not a step record ({e})") from None
    if not by_step:
        raise ValueError(f"{path} holds no records yet")
    return [by_step[step] for step in sorted(by_step)]


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def chart_data(records: list[dict], chart: Chart) -> dict[str, tuple[list, list]]:
    """What `chart` draws: for a line chart, label -> (steps, values) for every line some record has (a record
    without the key, or with null, is no point); for a histogram, {key: (indices, totals)} if any record has it."""
    if chart.histogram is not None:
        rows = [r[chart.histogram] for r in records if isinstance(r.get(chart.histogram), list)]
        if not rows:
            return {}
        totals = [0.0] * max(map(len, rows))
        for row in rows:
            for i, value in enumerate(row):
                totals[i] += value
        return {chart.histogram: (list(range(len(totals))), totals)}
    data = {}
    for line in chart.lines:
        points = [(r["step"], r[line.key] * line.scale) for r in records if _number(r.get(line.key))]
        if points:
            data[line.label] = ([s for s, _ in points], [v for _, v in points])
            if line.band is not None:
                spread = {r["step"]: r[line.band] * line.scale for r in records if _number(r.get(line.band))}
                data[f"{line.label} ±{line.band}"] = (data[line.label][0],
                                                      [spread.get(s, 0.0) for s in data[line.label][0]])
    return data


def draw(chart: Chart, data: dict[str, tuple[list, list]]):
    """A matplotlib figure of `chart` from its `chart_data` (pyplot is not used: no global state, no display)."""
    figure_cls = _matplotlib_figure()
    fig = figure_cls(figsize=(7, 4))
    fig.subplots_adjust(left=0.12, right=0.97, top=0.92, bottom=0.13)  # (fixed: a layout engine doubles the time)
    ax = fig.add_subplot()
    if chart.histogram is not None:
        x, heights = data[chart.histogram]
        ax.bar(x, heights, label=chart.histogram)
        ax.set_xticks(x)
    else:
        for line in chart.lines:
            if line.label not in data:
                continue
            steps, values = data[line.label]
            (drawn,) = ax.plot(steps, values, label=line.label, marker="." if len(steps) < 50 else None)
            if line.band is not None:
                spread = data[f"{line.label} ±{line.band}"][1]
                ax.fill_between(steps, [v - s for v, s in zip(values, spread, strict=True)],
                                [v + s for v, s in zip(values, spread, strict=True)], color=drawn.get_color(),
                                alpha=0.2, label=f"±{line.band}")
        ax.legend()
    ax.xaxis.set_major_locator(_integer_ticks())
    ax.set(title=chart.title, xlabel=chart.xlabel, ylabel=chart.ylabel)
    ax.grid(alpha=0.3)
    return fig


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> PlotReport:
    """Write `{chart.name}.png` for every chart of `CHARTS` that the run's records have data for, into `out_dir`
    (default: `run_dir/plots`)."""
    _matplotlib_figure()  # (no matplotlib: said before anything is read)
    records = read_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    report = PlotReport()
    for chart in CHARTS:
        data = chart_data(records, chart)
        keys = [chart.histogram] if chart.histogram is not None else [line.key for line in chart.lines]
        if not data:
            report.skipped.append(f"{chart.name}.png: no record of the run has {' or '.join(keys)}")
            continue
        for line in chart.lines:
            if line.label not in data:
                report.skipped.append(f"{line.key} in {chart.name}.png: no record of the run has it")
        fig = report.figures[chart.name] = draw(chart, data)
        fig.savefig(out / f"{chart.name}.png", dpi=100)
        report.written.append(out / f"{chart.name}.png")
    return report


def _integer_ticks():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _matplotlib_figure():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("tandem.plot needs matplotlib, an optional dependency (pip install 'tandem-rl[plot]', or "
                         "pip install matplotlib)") from None
    return Figure
