"""The soak's short form: one engine kill and one trainer kill (each followed by a resume) and every outside fault
against the run's engine, then a SIGTERM; no group trained twice, no token staler than the bound, the pools back
to baseline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# three legs of tandem run with kills and restarts take 40-60 s alone and, on a loaded 2-core machine, sometimes
# outlast their own timeouts: opt in (TANDEM_SOAK=1); BENCHMARKS.md holds the 30-minute soak
pytestmark = pytest.mark.skipif(not os.environ.get("TANDEM_SOAK"), reason="the soak's short form: set TANDEM_SOAK=1")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("soak")
    subprocess.run([sys.executable, "benchmarks/soak.py", "--minutes", "0.1", "--min-kills", "2", "--kill-every", "1",
                    "--fault-every", "1", "--pause-s", "0.3", "--out", str(out / "run"), "--json",
                    str(out / "soak.json"), "--set", "rollout.batch_groups=2", "rollout.group_size=2",
                    "random_agent.turns_max=2"], cwd=ROOT, check=True, timeout=240)
    return json.loads((out / "soak.json").read_text())


@pytest.mark.slow
def test_soak_survives_kills_and_outside_faults_without_duplicates_staleness_or_leaks(report):
    r = report
    assert r["unplanned"] == []
    assert r["faults"]["engine killed (SIGKILL)"] == r["faults"]["trainer killed (SIGKILL)"] == 1
    assert r["faults"]["pauses"] >= 1 and r["legs"] == 3
    assert r["steps_once_each"] and r["trainer_version"] == r["steps"] >= 3
    assert r["duplicates"] == 0 and r["groups_trained_and_dropped"] == 0
    assert r["staleness_violation_tokens"] == r["staleness_violation_steps"] == 0
    assert r["pools_back_to_baseline"]


@pytest.mark.slow
def test_soak_accounts_for_every_admitted_group(report):
    assert report["groups_unaccounted"] == 0
