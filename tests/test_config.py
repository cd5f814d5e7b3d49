"""Configs are checked against their declarations: every field's type, `Literal` choices and `Range` bounds, plus
the rules that relate fields; errors name `section.field`. `RunConfig.load` reads TOML and overrides."""

import dataclasses
import math
import re
import subprocess
import sys
import typing

import pytest

from tandem.config import (
    PAUSE_MODES,
    PRESETS,
    EngineConfig,
    LossConfig,
    RandomAgentConfig,
    Range,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
    check_fields,
)

CONFIGS = {"model": PRESETS["tiny"], "engine": EngineConfig(), "loss": LossConfig(),
           "random_agent": RandomAgentConfig(),
           "rollout": RolloutConfig(), "trainer": TrainerConfig(), "run": RunConfig()}


def fields(predicate=lambda hint: True):
    """(section, field name, its annotation) of every config field whose annotation satisfies `predicate`."""
    return [(section, name, hint) for section, config in CONFIGS.items()
            for name, hint in typing.get_type_hints(type(config), include_extras=True).items() if predicate(hint)]


def rejects(section, name, value, message=""):
    with pytest.raises(ValueError, match="^" + re.escape(f"{section}.{name}: must be {message}")):
        dataclasses.replace(CONFIGS[section], **{name: value})


@pytest.mark.parametrize("section, name, hint", fields())
def test_every_field_refuses_a_value_of_the_wrong_type(section, name, hint):
    rejects(section, name, object())
    if hint in (int, float) or typing.get_origin(hint) is typing.Annotated:
        rejects(section, name, True)  # a bool is an int to Python, never a number here


def _bound(hint):
    args = typing.get_args(typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Union else hint)
    return next((a for a in args if isinstance(a, Range)), None)


@pytest.mark.parametrize("section, name, hint", fields(_bound))
def test_every_declared_bound_is_enforced_at_its_edge(section, name, hint):
    bound = _bound(hint)
    step = 1 if int in typing.get_args(hint) or int in typing.get_args(typing.get_args(hint)[0]) else 1e-3
    outside = [x for x in (bound.gt, bound.lt) if x is not None and math.isfinite(x)]
    outside += [] if bound.ge is None else [bound.ge - step]
    outside += [] if bound.le is None else [bound.le + step]
    for value in outside:
        rejects(section, name, value, str(bound))
    if bound.lt == math.inf:
        rejects(section, name, math.inf)


@pytest.mark.parametrize("section, name, hint", fields(lambda hint: typing.get_origin(hint) is typing.Literal))
def test_every_choice_field_takes_its_choices_and_nothing_else(section, name, hint):
    choices = typing.get_args(hint)
    rejects(section, name, "nope", f"{', '.join(choices[:-1])} or {choices[-1]}, got 'nope'")
    if section != "run":  # the run's choices relate to each other: test_placement covers them
        for choice in choices:
            assert getattr(dataclasses.replace(CONFIGS[section], **{name: choice}), name) == choice


@dataclasses.dataclass
class Probe:
    """A field with no bound: only the type refuses NaN there."""

    x: float

    def __post_init__(self):
        check_fields(self)


@pytest.mark.parametrize("section, name", [("probe", "x"), ("loss", "eps_low"), ("rollout", "temperature")])
def test_a_number_field_refuses_nan(section, name):
    if section == "probe":
        with pytest.raises(ValueError, match=r"^probe\.x: must be a number, got nan"):
            Probe(math.nan)
    else:
        rejects(section, name, math.nan)


@pytest.mark.parametrize("make, message", [
    (lambda: PRESETS["tiny"].with_(num_attention_heads=3), "model.num_attention_heads: must be a multiple"),
    (lambda: PRESETS["tiny"].with_(head_dim=31), "model.head_dim: must be even"),
    (lambda: PRESETS["tiny"].with_(dtype="int8"), "model.dtype: must be float32, bfloat16 or float16"),
    (lambda: EngineConfig(page_size=0), "engine.page_size: must be positive, got 0"),
    (lambda: EngineConfig(kv_memory_fraction=1.0), "engine.kv_memory_fraction: must be > 0 and < 1"),
    (lambda: EngineConfig(max_context_len=0), "engine.max_context_len: must be positive"),
    (lambda: EngineConfig(host_cache="write_through", enable_prefix_cache=False),
     "engine.host_cache: write_through needs enable_prefix_cache"),
    (lambda: EngineConfig(watchdog_action="kill"), "engine.watchdog_action: must be wait or abort"),
    (lambda: LossConfig(behav_cap=0.5), "loss.behav_cap: must be >= 1"),
    (lambda: RandomAgentConfig(prompt_len_min=64, prompt_len_max=32),
     "random_agent.prompt_len_max: must be >= prompt_len_min (64), got 32"),
    (lambda: RandomAgentConfig(turns_min=3, turns_max=2), "random_agent.turns_max: must be >= turns_min (3)"),
    (lambda: RandomAgentConfig(max_context=128), "random_agent.max_context: must exceed prompt_len_max (128)"),
    (lambda: RolloutConfig(group_size=8, num_in_flight=4), "rollout.num_in_flight: must hold at least one group"),
    (lambda: RolloutConfig(top_p=1.5), "rollout.top_p: must be > 0 and <= 1"),
    (lambda: RolloutConfig(max_staleness=1.0), "rollout.max_staleness: must be an integer"),
    (lambda: TrainerConfig(weight_decay=-0.1), "trainer.weight_decay: must be >= 0"),
    (lambda: RunConfig(task=""), "run.task: must be a non-empty string"),
    (lambda: RunConfig(steps=1.5), "run.steps: must be an integer, got 1.5"),
    (lambda: RunConfig(engine={"page_size": 4}), "run.engine: must be an instance of EngineConfig"),
])
def test_bad_values_are_value_errors_naming_section_and_field(make, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        make()


def test_optional_fields_take_none_and_ints_pass_as_floats():
    assert EngineConfig(max_context_len=None, dump_dir=None, watchdog_timeout_s=0).watchdog_timeout_s == 0
    assert RunConfig(trainer_device=None, weight_sync_timeout_s=5).weight_sync_timeout_s == 5
    assert LossConfig(behav_cap=math.inf, eps_high=0).behav_cap == math.inf  # inf disables a cap
    assert RunConfig(task="my_pkg.envs:make_task").task == "my_pkg.envs:make_task"  # any name: the registry decides


def test_pause_modes_are_declared_once_and_taken_by_the_rollout():
    assert PAUSE_MODES == ("abort", "retract", "in_place")
    assert [RolloutConfig(pause_mode=mode).pause_mode for mode in PAUSE_MODES] == list(PAUSE_MODES)


def test_load_reads_toml_then_overrides_and_names_what_is_wrong(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('task = "target_tokens"\nsteps = 3\n[engine]\ndevice = "cpu"\npage_size = 8\n'
                    '[rollout]\nmax_staleness = 0\n')
    cfg = RunConfig.load(str(path), ["engine.page_size=4", "trainer.lr=1", "model=small", 'out_dir="a b"',
                                     "resume=true", "loss.eps_high=0.28", "trainer_device=cpu"])
    assert (cfg.task, cfg.steps, cfg.model, cfg.out_dir, cfg.resume, cfg.trainer_device) == (
        "target_tokens", 3, "small", "a b", True, "cpu")
    assert (cfg.engine.page_size, cfg.engine.device, cfg.rollout.max_staleness) == (4, "cpu", 0)
    assert (cfg.trainer.lr, cfg.loss.eps_high, cfg.rollout.group_size) == (1, 0.28, 4)  # the rest: defaults
    for overrides, message in [(["steps"], "override 'steps': expected section.key=value"),
                               (["stepz=3"], "run: unknown field 'stepz'"),
                               (["engine.pages=3"], "engine: unknown field 'pages'"),
                               (["engine=3"], "run.engine: must be a section, got 3"),
                               (["rollout.max_staleness=-1"], "rollout.max_staleness: must be >= 0, got -1"),
                               (["trainer.compile=yes"], "trainer.compile: must be true or false, got 'yes'")]:
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            RunConfig.load(None, overrides)


def test_config_imports_without_torch():
    code = "import sys, tandem.config; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
