"""Annotation-driven checks of the configs' fields (`tandem.config`): each field's annotation is its contract, its
type (`int`, `float`, `bool`, a non-empty `str`, `X | None`, `tuple[int, ...]`, a nested config), the `Literal`
choices it allows, and bounds declared as `Annotated[..., Range(...)]`. `check_fields` raises ValueError naming
`section.field`. Importable without torch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Literal, get_args


@dataclass(frozen=True, slots=True)
class Range:
    """Bounds of a number field, declared as `Annotated[float, Range(gt=0, lt=1)]`; None: no bound on that side."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def __contains__(self, x) -> bool:
        return ((self.gt is None or x > self.gt) and (self.ge is None or x >= self.ge)
                and (self.lt is None or x < self.lt) and (self.le is None or x <= self.le))

    def __str__(self) -> str:
        if self == Range(gt=0):
            return "positive"
        bounds = zip(("> ", ">= ", "< ", "<= "), (self.gt, self.ge, self.lt, self.le), strict=True)
        return " and ".join(f"{op}{bound}" for op, bound in bounds if bound is not None)


PositiveInt = Annotated[int, Range(gt=0)]
NonNegativeInt = Annotated[int, Range(ge=0)]
PositiveFloat = Annotated[float, Range(gt=0)]
NonNegativeFloat = Annotated[float, Range(ge=0)]


def _section(cls) -> str:
    """The name a config's fields go by in errors and in TOML: `RandomAgentConfig` -> `random_agent`."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__.removesuffix("Config")).lower()


@functools.cache
def field_hints(cls) -> dict:
    return typing.get_type_hints(cls, include_extras=True)


def _violation(value, hint) -> str | None:
    """What `value` must be to satisfy the annotation `hint`, or None when it does."""
    origin, args = typing.get_origin(hint), get_args(hint)
    if origin is Annotated:
        wrong = _violation(value, args[0])
        range_ = next((a for a in args[1:] if isinstance(a, Range)), None)
        return wrong or (None if range_ is None or value in range_ else str(range_))
    if origin in (typing.Union, types.UnionType):  # only `X | None` in these configs
        return None if value is None else _violation(value, next(a for a in args if a is not type(None)))
    if origin is Literal:  # (string choices only)
        return None if isinstance(value, str) and value in args else f"{', '.join(args[:-1])} or {args[-1]}"
    if origin is tuple:  # (of ints only in these configs)
        ok = isinstance(value, tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        return None if ok else "a tuple of integers"
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
        return None if ok else "a number"
    if hint is str:
        return None if isinstance(value, str) and value else "a non-empty string"
    if dataclasses.is_dataclass(hint):
        return None if isinstance(value, hint) else f"an instance of {hint.__name__}"
    raise TypeError(f"config fields cannot be annotated {hint!r}")


def check_fields(config) -> None:
    """Check every field of the dataclass `config` against its annotation; ValueError naming `section.field`."""
    for name, hint in field_hints(type(config)).items():
        value = getattr(config, name)
        wrong = _violation(value, hint)
        if wrong:
            raise ValueError(f"{_section(type(config))}.{name}: must be {wrong}, got {value!r}")
