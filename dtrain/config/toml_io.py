"""Reading TOML config files and writing a resolved JobConfig back out as TOML (or a plain dict).

The writer covers exactly the value types the schema allows (bool, int, float, str, lists of str, tables of
scalars or of inline tables of scalars) so that its output loads back into an equal config; TOML has no null, so
unset (None) fields are left out and load back as their default, which is None.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

from dtrain.config.fields import config_fields, section_names, section_of
from dtrain.config.schema import JobConfig
from dtrain.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

# TOML basic-string escapes; every other control character (and DEL) is written as \uXXXX.
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; a syntax error or unreadable file is a one-line ConfigError naming the file."""
    try:
        # utf-8-sig: editors on Windows save a byte-order mark, which tomllib reads as a stray character.
        with open(path, encoding="utf-8-sig", newline="") as f:
            return tomllib.loads(f.read())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"cannot parse {path}: {err}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"cannot parse {path}: not UTF-8 text") from None
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}") from None


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """The config as {section: {key: value}} with fresh lists (None kept for unset fields)."""
    return dataclasses.asdict(cfg)


def toml_string(text: str) -> str:
    """`text` as a TOML basic string."""
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    """A config value as a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest round-tripping form, e.g. 0.0008 or 1e-08; both are valid TOML
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):  # an inline table; its keys are field names (bare TOML keys)
        return "{" + ", ".join(f"{key} = {toml_value(item)}" for key, item in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} value {value!r} as TOML")


def to_toml(cfg: JobConfig) -> str:
    """The whole resolved config as TOML: every section and every set key, in schema order; a table field
    (e.g. model.args) follows its section as its own [section.key] table, and a nested section is its own
    [quantize.linear.float8] table."""
    lines = ["# Resolved dtrain config: defaults, then the TOML file, then command-line overrides."]
    specs = list(config_fields().values())
    for section in section_names():
        values = {s.name: getattr(section_of(cfg, section), s.name) for s in specs if s.section == section}
        lines.append("")
        lines.append(f"[{section}]")
        tables = {key: value for key, value in values.items() if isinstance(value, dict)}
        lines.extend(
            f"{key} = {toml_value(value)}" for key, value in values.items() if value is not None and key not in tables
        )
        for key, table in tables.items():
            if table:
                lines.append(f"[{section}.{key}]")
                lines.extend(f"{name} = {toml_value(value)}" for name, value in table.items() if value is not None)
    return "\n".join(lines) + "\n"
