"""`--help` text: how configs resolve, the flag syntax, then every section and key with type, default and doc."""

from __future__ import annotations

import shlex
import textwrap
from typing import Any

from dtrain.config.fields import FieldSpec, config_fields, section_names, section_of
from dtrain.config.schema import JobConfig

_HEADER = """\
usage: run_train.sh [--config NAME|PATH] [--section.key VALUE ...] [-h | --help]

Settings resolve in three layers; each overrides the one before:
  1. the built-in defaults,
  2. the TOML file picked by --config NAME|PATH (also --job.config_file PATH, or $CONFIG_FILE; default:
     debug_model). An existing path is used as is; otherwise NAME, with or without .toml, is looked up in
     train_configs/ at the repo root (or $DTRAIN_CONFIGS_DIR),
  3. the command-line flags below.
{defaults_note}

Flag syntax (hyphens may replace underscores in keys):
  --section.key VALUE   or   --section.key=VALUE
  booleans  --compile.enable   --compile.no_enable   --compile.enable true|false|1|0|yes|no
  lists     comma-separated: --compile.components model,loss   ('' is the empty list)
  optional  keys shown with |none are unset by the value none: --lr_scheduler.decay_ratio none
"""


def cli_literal(value: Any) -> str:
    """A value as one would type it on the command line (quoted for the shell where needed)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return shlex.quote(",".join(" ".join(item) if isinstance(item, list) else item for item in value))
    if isinstance(value, dict):
        return " ".join(f"{name}={cli_literal(item)}" for name, item in value.items()) or "empty"
    return shlex.quote(str(value))


def _flag_line(spec: FieldSpec, value: Any) -> str:
    if spec.kind == "bool":
        usage = f"--{spec.key} | --{spec.section}.no_{spec.name}" + (f" | --{spec.key} none" if spec.optional else "")
    elif spec.kind == "table":
        usage = f"--{spec.key}.NAME VALUE"
    else:
        base = {"list": "LIST", "nested_list": "LISTS"}.get(spec.kind, spec.kind.upper())
        metavar = "{" + ",".join(str(c) for c in spec.choices) + "}" if spec.choices else base
        usage = f"--{spec.key} {metavar}" + ("|none" if spec.optional else "")
    facts = [f"default: {cli_literal(value)}"]
    if spec.minimum is not None:
        facts.append(f">= {spec.minimum:g}")
    return f"  {usage}  ({'; '.join(facts)})"


def format_help(cfg_defaults: JobConfig | None = None) -> str:
    """The full --help text; defaults are read from `cfg_defaults` (the schema's defaults when None).

    Passing the config resolved from the rest of the command line (`--config llama3_8b --help`) shows that
    file's values as the defaults.
    """
    if cfg_defaults is None:
        cfg, note = JobConfig(), 'Values shown as "default" are the built-in defaults (a TOML file may change them).'
    else:
        cfg, note = cfg_defaults, 'Values shown as "default" are what this command line resolves to (TOML and flags).'
    lines = [_HEADER.format(defaults_note=note)]
    specs = list(config_fields().values())
    for section in section_names():
        lines.append(f"[{section}]")
        for spec in (s for s in specs if s.section == section):
            lines.append(_flag_line(spec, getattr(section_of(cfg, section), spec.name)))
            lines.extend(textwrap.wrap(spec.doc, width=110, initial_indent="      ", subsequent_indent="      "))
        lines.append("")
    return "\n".join(lines)
