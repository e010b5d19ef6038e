"""Turning command-line text and TOML/Python values into typed config values, and checking choices and bounds.

Every failure is a one-line ConfigError that names the key, what it expects, and what it got. `source` (a TOML
file path, when there is one) is appended so that the user knows which file to edit.
"""

from __future__ import annotations

import math
import re
from typing import Any

from dtrain.config.fields import FieldSpec
from dtrain.errors import ConfigError

TRUE_WORDS = ("true", "1", "yes")
FALSE_WORDS = ("false", "0", "no")
NONE_WORD = "none"

EXPECTS = {
    "bool": "a boolean (true/false)",
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "list": "a list of strings",
    "nested_list": "a list of lists of strings (or of space-separated strings)",
    "table": "a table of key = value pairs (TOML [section.key], or --section.key.NAME VALUE)",
}
# Python's int() also accepts spaces and underscores; a config integer is plain decimal digits with a sign.
INT_TEXT = re.compile(r"[+-]?\d+")


def _scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str))


def _in(source: str | None) -> str:
    return f" (in {source})" if source else ""


def show_value(value: Any) -> str:
    """A value as a message quotes it: strings quoted, booleans spelled as in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _type_error(
    spec: FieldSpec, got: Any, source: str | None, expects: str | None = None, or_none: bool = False
) -> ConfigError:
    expects = (expects or EXPECTS[spec.kind]) + (" or none" if or_none else "")
    return ConfigError(f"{spec.key} expects {expects}, got {show_value(got)}{_in(source)}")


def parse_bool_word(text: str) -> bool | None:
    """true/1/yes -> True, false/0/no -> False (any case); anything else -> None."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    return None


def parse_cli_value(spec: FieldSpec, text: str) -> Any:
    """Parse the text given for `spec` on the command line, then check its choices and minimum."""
    if spec.optional and text.strip().lower() == NONE_WORD:
        return None
    or_none = spec.optional  # say "or none" where the field can be unset from the command line
    if spec.kind == "bool":
        value = parse_bool_word(text)
        if value is None:
            raise _type_error(spec, text, None, "true/false, 1/0 or yes/no", or_none)
    elif spec.kind == "int":
        if not INT_TEXT.fullmatch(text.strip()):
            raise _type_error(spec, text, None, or_none=or_none)
        value = int(text)
    elif spec.kind == "float":
        try:
            value = float(text)
        except ValueError:
            raise _type_error(spec, text, None, or_none=or_none) from None
        if not math.isfinite(value):
            raise _type_error(spec, text, None, "a finite number", or_none)
    elif spec.kind == "list":
        # Comma-separated; an empty string is the empty list (`--checkpoint.exclude_from_loading ""`).
        value = [item.strip() for item in text.split(",") if item.strip()]
    elif spec.kind == "nested_list":
        # Commas separate the inner lists, spaces their items: `--x "a b,c d"` is [["a", "b"], ["c", "d"]].
        value = [item.split() for item in text.split(",") if item.strip()]
    else:
        value = text
    return check_constraints(spec, value)


def coerce_value(spec: FieldSpec, value: Any, source: str | None = None, constraints: bool = True) -> Any:
    """Check a value that is already a Python object (from TOML or code) and return it in the field's type; with
    `constraints`, check its choices and minimum too.

    Integers are accepted for float fields (TOML `lr = 1` means 1.0); nothing else is converted, so that a quoted
    number, a float for an integer, or a string for a boolean is reported rather than silently reinterpreted.
    """
    if value is None and spec.optional:
        return None
    kind = spec.kind
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            raise _type_error(spec, value, source, "a finite number")
        value = float(value) if ok else value
    elif kind == "list":
        ok = isinstance(value, list) and all(isinstance(item, str) for item in value)
        value = list(value) if ok else value
    elif kind == "table":
        # Scalars, or tables of scalars (a structured model arg such as [model.args.rope_scaling]); what each entry
        # may be is checked where the table is used (e.g. the family's args).
        ok = isinstance(value, dict) and all(
            isinstance(k, str) and (_scalar(v) or (isinstance(v, dict) and all(map(_scalar, v.values()))))
            for k, v in value.items()
        )
        value = {k: dict(v) if isinstance(v, dict) else v for k, v in value.items()} if ok else value
    elif kind == "nested_list":
        # Each inner list as a TOML list of strings (torchtitan's form) or as one space-separated string.
        ok = isinstance(value, list) and all(
            isinstance(item, str) or (isinstance(item, list) and all(isinstance(s, str) for s in item))
            for item in value
        )
        value = [item.split() if isinstance(item, str) else list(item) for item in value] if ok else value
    else:
        ok = isinstance(value, str)
        if not ok and isinstance(value, (int, float)) and not isinstance(value, bool):
            raise _type_error(spec, value, source, "a string (quote it in TOML)")
    if not ok:
        raise _type_error(spec, value, source)
    return check_constraints(spec, value, source) if constraints else value


def check_constraints(spec: FieldSpec, value: Any, source: str | None = None) -> Any:
    """Check `value` against the field's choices and minimum; returns it (choices in their canonical case)."""
    if value is None:
        return value
    if spec.choices is not None:
        if value not in spec.choices:
            # Accept a different case (`adamw` for AdamW) but store the canonical spelling.
            folded = [c for c in spec.choices if isinstance(value, str) and c.lower() == value.lower()]
            if not folded:
                valid = ", ".join(str(c) for c in spec.choices)
                raise ConfigError(f"{spec.key} must be one of {valid}; got {show_value(value)}{_in(source)}")
            value = folded[0]
    if spec.minimum is not None and value < spec.minimum:
        raise ConfigError(f"{spec.key} must be >= {spec.minimum:g}; got {show_value(value)}{_in(source)}")
    return value
