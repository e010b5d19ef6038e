"""Command-line parsing: `--config NAME` and `--section.key value` overrides, typed against the schema.

Accepted forms (hyphens may replace underscores anywhere in the key):
    --section.key value     --section.key=value
    --compile.enable        --compile.no_enable     --compile.enable false   (also 1/0, yes/no)
    --compile.components model,loss                 (lists are comma-separated; "" is the empty list)
    --lr_scheduler.decay_ratio none                 (unsets an optional key)
    --config NAME | PATH    --config=NAME           --job.config_file PATH   (torchtitan's spelling)
    --model.args.n_layers 2                         (an entry of a table; its type is checked where it is used)
    --fault_tolerance.enable false                  (a torchtitan key without a dtrain field: torchtitan_keys.py)
`-h` / `--help` are recorded but not acted on: the entry point prints `format_help` and exits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dtrain.config.fields import FieldSpec, config_fields, unknown_key_message
from dtrain.config.torchtitan_keys import TORCHTITAN_ONLY
from dtrain.config.values import EXPECTS, INT_TEXT, NONE_WORD, parse_bool_word, parse_cli_value
from dtrain.errors import ConfigError

HELP_FLAGS = ("-h", "--help")
CONFIG_KEYS = ("config", "job.config_file")


@dataclass
class ParsedArgs:
    """What the command line asked for, before any file is read."""

    config: str | None = None  # the last --config / --job.config_file value, unresolved
    overrides: list[tuple[FieldSpec, Any]] = field(default_factory=list)  # typed values, in command-line order
    foreign: dict[str, Any] = field(default_factory=dict)  # torchtitan-only keys (torchtitan_keys.py), as parsed
    help: bool = False


def help_requested(argv: Sequence[str]) -> bool:
    """Whether the command line asks for --help / -h (checked before anything else can fail)."""
    return any(token in HELP_FLAGS for token in argv)


def _next_value(argv: Sequence[str], i: int, flag: str, expects: str) -> str:
    """The token after `flag`, which must exist and must not itself be a --flag."""
    if i >= len(argv) or argv[i].startswith("--"):
        raise ConfigError(f"{flag} expects a value ({expects})")
    return argv[i]


def _table_entry(key: str) -> tuple[FieldSpec, str] | None:
    """(the table field, entry name) when `key` is `section.table.entry`, else None."""
    section, _, rest = key.partition(".")
    table, _, entry = rest.partition(".")
    spec = config_fields().get(f"{section}.{table}")
    return (spec, entry) if spec is not None and spec.kind == "table" and entry else None


def _negated_bool(key: str) -> FieldSpec | None:
    """The boolean field that `section.no_name` switches off, or None when `key` is not of that form."""
    section, _, name = key.rpartition(".")
    if not name.startswith("no_"):
        return None
    spec = config_fields().get(f"{section}.{name[3:]}")
    if spec is None:
        return None
    if spec.kind != "bool":
        raise ConfigError(f"--{key} is not valid: {spec.key} is not a boolean (give --{spec.key} VALUE)")
    return spec


def _is_bool_value(spec: FieldSpec, token: str) -> bool:
    """Whether `token` is a value for the boolean `spec` rather than the next argument."""
    return parse_bool_word(token) is not None or (spec.optional and token.strip().lower() == NONE_WORD)


def _foreign_value(text: str) -> Any:
    """A torchtitan-only key's command-line value as its TOML value would be: a boolean, an integer, a
    comma-separated list (torchtitan's spelling of lists on the command line) or text."""
    word = parse_bool_word(text)
    if word is not None:
        return word
    if INT_TEXT.fullmatch(text):
        return int(text)
    return [item for item in text.split(",") if item] if "," in text else text


def parse_argv(argv: Sequence[str]) -> ParsedArgs:
    """Parse the command line into a config choice and typed overrides; raises ConfigError on the first problem."""
    specs = config_fields()
    parsed = ParsedArgs()
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token in HELP_FLAGS:
            parsed.help = True
            continue
        if not token.startswith("--") or token == "--":
            raise ConfigError(
                f"unexpected argument {token!r}: options look like --section.key value or --config NAME (see --help)"
            )
        name, has_value, inline = token[2:].partition("=")
        key = name.replace("-", "_")
        flag = f"--{key}"
        if key in CONFIG_KEYS:
            if not has_value:
                inline = _next_value(argv, i, flag, "a config name in train_configs/ or a path to a .toml file")
                i += 1
            parsed.config = inline
            continue

        spec = specs.get(key)
        entry = _table_entry(key) if spec is None else None
        if entry is not None:
            table, entry_name = entry
            if not has_value:
                inline = _next_value(argv, i, flag, "a value")
                i += 1
            # Kept as text: the table's user knows each entry's type (and says "none" where it may be unset).
            parsed.overrides.append((table, {entry_name: inline}))
            continue
        if spec is None and key in TORCHTITAN_ONLY:
            if not has_value:
                inline = _next_value(argv, i, flag, "a value")
                i += 1
            parsed.foreign[key] = _foreign_value(inline)
            continue
        if spec is None:
            negated = _negated_bool(key)
            if negated is None:
                raise ConfigError(unknown_key_message(key))
            if has_value:
                raise ConfigError(f"{flag} takes no value (to give one, write --{negated.key}=VALUE)")
            parsed.overrides.append((negated, False))
            continue

        if not has_value:
            if spec.kind == "bool":
                # A bare boolean flag means true; an explicit true/false word (or none, where the key can be unset)
                # right after it is its value.
                if i < len(argv) and _is_bool_value(spec, argv[i]):
                    inline = argv[i]
                    i += 1
                else:
                    parsed.overrides.append((spec, True))
                    continue
            else:
                expects = EXPECTS[spec.kind] + (" or none" if spec.optional else "")
                inline = _next_value(argv, i, flag, expects)
                i += 1
        parsed.overrides.append((spec, parse_cli_value(spec, inline)))
    return parsed
