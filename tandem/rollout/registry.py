"""Tasks by name: what `task=` of a run resolves to.

A task is a function `task(cfg: RunConfig, vocab_size: int) -> EnvFactory`, called once per run in the process
that runs the rollout manager. It may do the run's one-time work there (load a dataset or a tokenizer from
`cfg.model`, start a tool server) and returns the per-episode factory `(group_seed, sample) -> Environment` (see
`tandem.rollout.env`). `task=` names one of `TASKS` or a user's own as `package.module:function`, imported
from `sys.path` (e.g. `PYTHONPATH=examples tandem run task=calculator:task`; see `examples/README.md`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial

from tandem.config import RunConfig
from tandem.rollout import chat_agent
from tandem.rollout.env import EnvFactory
from tandem.rollout.random_agent import RandomAgentEnv
from tandem.rollout.tasks import GuessNumberEnv, TargetTokensEnv

Task = Callable[[RunConfig, int], EnvFactory]

TASKS: dict[str, Task] = {
    "random": lambda cfg, vocab_size: partial(RandomAgentEnv, cfg.random_agent, vocab_size),
    "target_tokens": lambda cfg, vocab_size: partial(TargetTokensEnv, vocab_size),
    "guess_number": lambda cfg, vocab_size: partial(GuessNumberEnv, vocab_size),
    "chat_agent": chat_agent.task,  # a tool-calling chat agent through the session chat endpoint
}


def resolve_task(spec: str) -> Task:
    """The task `spec` names: a key of `TASKS`, or `package.module:function`. ValueError (naming `run.task`
    and what was tried) for anything else."""
    if isinstance(spec, str) and spec in TASKS:
        return TASKS[spec]
    module_name, _, name = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not module_name or not name:
        raise ValueError(f"run.task: {spec!r} is neither a registered task ({', '.join(TASKS)}) nor "
                         "package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:  # also a missing dependency of the user's module: the message names it
        raise ValueError(f"run.task: cannot import module {module_name!r} of {spec!r} ({e})") from e
    task = getattr(module, name, None)
    if not callable(task):
        found = "nothing" if task is None else f"a {type(task).__name__}"
        raise ValueError(f"run.task: {spec!r}: module {module_name!r} ({module.__file__}) has {found} named "
                         f"{name!r}, not a function (cfg, vocab_size) -> EnvFactory")
    return task


def make_env_factory(cfg: RunConfig, vocab_size: int) -> EnvFactory:
    """The per-episode factory of `cfg.task`, built for this run."""
    factory = resolve_task(cfg.task)(cfg, vocab_size)
    if not callable(factory):
        raise ValueError(f"run.task: {cfg.task!r} returned a {type(factory).__name__}, not a function "
                         "(group_seed, sample) -> Environment")
    return factory
