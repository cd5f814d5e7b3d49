"""Checks of the code a GPU would run, made on a CPU: a script that compiles kernels for sm_90 with Triton's own
ptxas, run in a process of its own (the test's process runs Triton's interpreter)."""

import json
import os
import subprocess
import sys

import pytest


def run_compile_check(script: str, timeout: float = 300) -> dict:
    """The JSON object `script` prints last, run without TRITON_INTERPRET; skips the test where the script reports
    `{"skip": why}` (this Triton cannot compile for sm_90 here)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in found:
        pytest.skip(f"this Triton cannot compile for sm_90 here: {found['skip']}")
    return found
