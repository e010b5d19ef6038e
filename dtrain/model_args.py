"""`[model.args]`: overrides of a flavor's shape, checked against the model family's args class.

The config system cannot know the fields (they depend on `model.name`), so it keeps the table as given (command
line values as text) and the overrides are typed and checked here, once the family is known: an unknown name
gets "did you mean", a wrong type or value one line naming `model.args.<field>`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any

from dtrain.config.values import INT_TEXT, NONE_WORD, parse_bool_word, show_value
from dtrain.errors import ConfigError
from dtrain.models import ModelFamily

KEY = "model.args"


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        return (members[0] if len(members) == 1 else annotation), True
    return annotation, False


def _typed(key: str, annotation: Any, value: Any) -> Any:
    """`value` (TOML-typed, or command-line text) as the field's type; ConfigError naming `key` otherwise."""
    kind, optional = _unwrap_optional(annotation)
    text = value.strip() if isinstance(value, str) else None
    if optional and text is not None and text.lower() == NONE_WORD:
        return None
    if kind is bool:
        typed = value if isinstance(value, bool) else parse_bool_word(text) if text is not None else None
        if typed is None:
            raise ConfigError(f"{key} expects a boolean (true/false), got {show_value(value)}")
        return typed
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if text is not None and INT_TEXT.fullmatch(text):
            return int(text)
        raise ConfigError(f"{key} expects an integer{' or none' if optional else ''}, got {show_value(value)}")
    if kind is float:
        try:
            typed = float(value) if not isinstance(value, bool) else math.nan
        except ValueError:
            typed = math.nan
        if not math.isfinite(typed):
            raise ConfigError(f"{key} expects a number{' or none' if optional else ''}, got {show_value(value)}")
        return typed
    if kind is str:
        return str(value)
    # A structured field (e.g. Llama's rope_scaling): the flavor's value, or none.
    raise ConfigError(f"{key} can only be set to none here (its value comes from the flavor), got {show_value(value)}")


def typed_overrides(family: ModelFamily, overrides: dict[str, Any]) -> dict[str, Any]:
    """The `[model.args]` table checked against `family`'s args class: {field: value of the field's type}."""
    hints = typing.get_type_hints(family.args_cls)
    names = [f.name for f in dataclasses.fields(family.args_cls)]
    typed = {}
    for name, value in overrides.items():
        key = f"{KEY}.{name}"
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
            hint = f"did you mean {KEY}.{close[0]}?" if close else f"{family.name} has {', '.join(names)}"
            raise ConfigError(f"unknown key {key} ({hint})")
        typed[name] = _typed(key, hints[name], value)
    return typed


def apply_overrides(family: ModelFamily, base: Any, overrides: dict[str, Any]) -> Any:
    """`base` (a flavor's args) with the typed `overrides`; the args class's own checks become one-line errors."""
    try:
        return dataclasses.replace(base, **overrides)
    except ValueError as err:
        raise ConfigError(f"{KEY}: {err}") from None


def shape_table(args: Any) -> dict[str, Any]:
    """The resolved shape as a `[model.args]` table: every field TOML can hold (unset and structured ones left to
    the flavor)."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(args)
        if isinstance(getattr(args, f.name), (bool, int, float, str))
    }
