"""`tandem run`'s live table fits the terminal: a narrow one drops the least important columns whole instead of
squeezing every header into letters."""

import io

import pytest
from rich.console import Console

from tandem.run.main import COLUMNS, RunTable

RECORD = dict(step=12, version=12, in_flight_episodes=48, buffered_groups=3, reward_mean=-0.0123, staleness_mean=1.25,
              staleness_max=2, trained_tokens_per_s=123456, rollout_tokens_per_s=234567, cache_hit_rate=0.734,
              cache_reuse_vs_ideal=0.912, mismatch_kl=1.2e-4, clip_frac=0.03, transfer_s=0.0123, pause_s=0.0045,
              wait_s=1.5)


def render(width: int, records: list[dict]) -> tuple[list[str], list[str]]:
    """The rendered lines and the headers read back from the header row."""
    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(RunTable(records))
    lines = console.export_text().splitlines()
    header = next(i for i, line in enumerate(lines) if "step" in line)
    assert lines[header + 1].startswith("┡"), "a header wrapped onto a second line"
    return lines, [h.strip() for h in lines[header].strip("┃").split("┃")]


@pytest.mark.parametrize("records", [[], [RECORD] * 3], ids=["before the first step", "three steps"])
def test_narrow_consoles_drop_whole_columns_and_keep_the_essential_ones(records):
    shown = {}
    for width in (80, 160):
        lines, headers = render(width, records)
        assert all(len(line) <= width for line in lines)
        assert all(len(h) >= 3 for h in headers), headers
        assert set(headers) <= {c.header for c in COLUMNS}  # whole headers, none cut
        assert {"step", "reward"} <= set(headers)
        shown[width] = headers
    assert len(shown[80]) < len(shown[160])
    assert render(400, records)[1] == [c.header for c in COLUMNS]  # all of them when there is room


def test_missing_values_show_as_a_dash_and_milliseconds_are_scaled():
    _, headers = render(400, [RECORD])
    lines, _ = render(400, [{"step": 1, "transfer_s": 0.0123}])
    row = [cell.strip() for cell in lines[-2].strip("│").split("│")]
    assert row[headers.index("sync ms")] == "12.3" and row[headers.index("reward")] == "-"
