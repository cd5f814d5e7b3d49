"""The two entry points as a user starts them: real subprocesses, real signals, a real port."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

TANDEM = [sys.executable, "-m", "tandem.cli"]


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# a small batch of short episodes: a step takes a fraction of a second, so the run is interrupted soon after its
# second step and the step it is in when SIGINT comes finishes quickly (the default's batch of 16 long episodes made
# that minutes on a loaded machine)
SMALL_RUN = ["rollout.batch_groups=2", "rollout.group_size=2", "rollout.num_in_flight=8",
             "random_agent.prompt_len_max=20", "random_agent.response_len_median=4", "random_agent.response_len_max=16",
             "random_agent.max_context=128"]


def test_run_stops_cleanly_on_ctrl_c_with_a_checkpoint(tmp_path):
    """SIGINT saves a checkpoint at the last recorded step and exits 130. (`checkpoint_every=0`: no periodic
    checkpoint, so the one found can only be the interrupt's.)"""
    metrics = tmp_path / "metrics.jsonl"
    # (SIGINT at its default in the run, as in a terminal: a suite started in the background by a script inherits
    # it ignored, as every background job of a non-interactive shell does, and a run respects that)
    proc = subprocess.Popen([*TANDEM, "run", "steps=100000", "checkpoint_every=0", *SMALL_RUN, f"out_dir={tmp_path}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2, 120, "two steps")
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # (`tandem run` writes every thread's stack)
            time.sleep(2)
            proc.kill()
            raise AssertionError("no exit within 60 s of SIGINT; its output and threads:\n"
                                 + proc.communicate()[0].decode(errors="replace")[-12000:]) from None
    finally:
        proc.kill()
    assert proc.returncode == 130, out.decode()[-2000:]  # interrupted is no success (128 + SIGINT)
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert state["trainer"]["version"] == steps[-1] >= 2
    assert b"interrupted: checkpoint saved" in out


@pytest.mark.parametrize("tp", [1, 2])
def test_serve_answers_on_its_port_and_bad_config_is_a_clear_error(tp, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tier = ["--host-cache", "write_through"] if tp == 2 else []
    proc = subprocess.Popen([*TANDEM, "serve", "--model", "tiny", "--port", str(port), "--num-pages", "64",
                             "--tp", str(tp), *tier], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: healthy(port), 60, "the server")
        r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"input_ids": [1, 2, 3],
                                                                  "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log = proc.communicate(timeout=30)[0]  # (the end of output too: no follower keeps the pipe open)
    assert b"KV cache: 64 device pages" in log and (b"128 host pages" in log) == (tp == 2)  # the start-up sizes
    from tandem.cli import main  # (in this process: the same `main` a subprocess runs, without its second start-up)

    with pytest.raises(SystemExit) as bad:
        main(["serve", "--model", "no-such-model"])
    assert bad.value.code == 2 and "neither a preset" in capsys.readouterr().err


def test_serve_choices_are_the_configs(capsys):
    """`--host-cache` and `--dtype` offer exactly the choices the config declares."""
    from tandem.cli import main

    for flag in ("--host-cache", "--dtype"):
        with pytest.raises(SystemExit) as e:
            main(["serve", flag, "bogus"])
        assert e.value.code == 2
    err = capsys.readouterr().err
    for choices in (("off", "write_through", "write_back"), ("float32", "bfloat16", "float16")):
        quoted = ", ".join(f"'?{c}'?" for c in choices)  # argparse quotes them before Python 3.12.8
        assert re.search(rf"choose from {quoted}\)", err), err


def test_serve_a_moe_checkpoint_directory_with_expert_parallelism(tmp_path, capsys):
    """`tandem serve --model DIR --ep 2` on a Hugging Face Qwen3-MoE checkpoint (one tensor per expert) answers what
    one in-process engine on the same directory does; `--ep` on a dense model, or one that does not divide the
    experts, is a clear error."""
    import asyncio
    import dataclasses

    from hf_ref import hf_model
    from test_moe import MOE_SHAPES

    from tandem.config import EngineConfig
    from tandem.engine.engine import Engine
    from tandem.types import SamplingParams

    six_experts = dataclasses.replace(MOE_SHAPES["dense_first_norm"], num_experts=6)
    hf_model(six_experts, seed=7).save_pretrained(tmp_path / "moe")
    from tandem.cli import main

    for model, ep, why in [("tiny", 2, "has none"), (str(tmp_path / "moe"), 4, "must divide")]:
        with pytest.raises(SystemExit) as exit_:  # (refused before any process starts)
            main(["serve", "--model", model, "--ep", str(ep)])
        assert exit_.value.code == 2 and why in capsys.readouterr().err
    prompt, sampling = [5, 9, 17, 33, 2, 8], {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with Engine(str(tmp_path / "moe"), EngineConfig(page_size=16, num_pages=64)) as engine:
        expected = asyncio.run(engine.generate(prompt, SamplingParams(**sampling))).output_ids
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*TANDEM, "serve", "--model", str(tmp_path / "moe"), "--port", str(port),
                             "--num-pages", "64", "--ep", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: healthy(port), 120, "the server")
        r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"input_ids": prompt, "sampling_params": sampling},
                       timeout=60)
        assert r.status_code == 200 and r.json()["output_ids"] == expected
    finally:
        proc.terminate()
        proc.wait(timeout=30)
