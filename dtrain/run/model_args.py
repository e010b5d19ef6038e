"""`[model.args]`: the model's shape, as overrides of a flavor's or (with no flavor) whole, checked against the model
family's args class.

The config system cannot know the fields (they depend on `model.name`), so it keeps the table as given (command
line values as text) and the values are typed and checked here, once the family is known: an unknown name gets
"did you mean", a wrong type or value one line naming `model.args.<field>`. A structured field (Llama's RoPE
scaling, DeepSeek's YaRN settings) is a table that gives every one of its fields (`[model.args.rope_scaling]`, or
inline); `none` unsets an optional field.

`shape_table` writes resolved args back as such a table, every field included, so that a run's config.toml rebuilds
the model it trained whatever its flavor says (or later becomes). A value TOML cannot hold is written as
`UNRECORDED` and refused in one line when the table is read back, never guessed.
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
# What shape_table writes for a field whose value has no TOML form; reading it back is refused.
UNRECORDED = "unrecorded"


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
    if text == UNRECORDED:
        raise ConfigError(f"{key} was not recorded (the run's value has no TOML form), so this config cannot rebuild "
                          "its model")
    if dataclasses.is_dataclass(kind):
        return _structured(key, kind, value)
    raise ConfigError(f"{key} can only be set to none here (its value has no TOML form), got {show_value(value)}")


def _structured(key: str, cls: type, value: Any) -> Any:
    """A structured field (a dataclass of scalars) from its table, which gives every field: nothing is guessed."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    if not isinstance(value, dict):
        raise ConfigError(
            f"{key} expects a table of {', '.join(names)} (TOML [{key}]) or none, got {show_value(value)}"
        )
    for name in value:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
            hint = f"did you mean {key}.{close[0]}?" if close else f"valid: {', '.join(names)}"
            raise ConfigError(f"unknown key {key}.{name} ({hint})")
    missing = [name for name in names if name not in value]
    if missing:
        raise ConfigError(f"{key} lacks {key}.{missing[0]} (its table gives every field: {', '.join(names)})")
    hints = typing.get_type_hints(cls)
    try:
        return cls(**{name: _typed(f"{key}.{name}", hints[name], value[name]) for name in names})
    except ValueError as err:
        raise ConfigError(f"{KEY}: {err}") from None


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


def base_args(family: ModelFamily, flavor: str, overrides: dict[str, Any]) -> Any:
    """The args `[model]` describes: the flavor's with the typed `overrides`, or, with no flavor (an empty
    `model.flavor`, as a run started from a Hugging Face config.json records), the overrides alone, which must then
    give every field."""
    if flavor:
        if flavor not in family.flavors:
            valid = ", ".join(family.flavors)
            raise ConfigError(f"model.flavor '{flavor}' is not a {family.name} flavor (valid: {valid}, or empty with "
                              f"every {KEY} field given)")
        return apply_overrides(family, family.flavors[flavor], overrides)
    missing = [f.name for f in dataclasses.fields(family.args_cls) if f.init and f.name not in overrides]
    if missing:
        raise ConfigError(f"model.flavor is empty, so [{KEY}] must give every field; it lacks {KEY}.{missing[0]}"
                          + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    try:
        return family.args_cls(**overrides)
    except ValueError as err:
        raise ConfigError(f"{KEY}: {err}") from None


def shape_table(args: Any) -> dict[str, Any]:
    """The resolved args as a `[model.args]` table that rebuilds them exactly: every field, an unset one as none,
    a structured one as its table, one TOML cannot hold as UNRECORDED."""
    return {f.name: _recorded(getattr(args, f.name)) for f in dataclasses.fields(args) if f.init}


def _recorded(value: Any) -> Any:
    if value is None:
        return NONE_WORD
    if isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        table = {f.name: _recorded(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        # The config's tables hold one level of tables of scalars.
        if not any(isinstance(item, dict) or item == UNRECORDED for item in table.values()):
            return table
    return UNRECORDED
