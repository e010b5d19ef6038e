"""`load_config`: dataclass defaults, overlaid by a TOML file, overlaid by command-line flags, then validated.

Which TOML file: `--config NAME|PATH` (or `--job.config_file PATH`, torchtitan's spelling), else the CONFIG_FILE
environment variable, else `debug_model`. A path that exists is used as is; otherwise a bare name, with or without
`.toml`, is looked up in the configs folder (`train_configs/` at the repo root, or $DTRAIN_CONFIGS_DIR).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dtrain.config.cli import parse_argv
from dtrain.config.fields import (
    config_fields,
    section_classes,
    section_of,
    unknown_key_message,
    unknown_section_message,
)
from dtrain.config.schema import JobConfig
from dtrain.config.toml_io import read_toml
from dtrain.config.validate import canonical_schedule, validate_config
from dtrain.config.values import coerce_value
from dtrain.errors import ConfigError

ENV_CONFIG_FILE = "CONFIG_FILE"
ENV_CONFIGS_DIR = "DTRAIN_CONFIGS_DIR"
DEFAULT_CONFIG_NAME = "debug_model"


def default_configs_dir(env: Mapping[str, str] = os.environ) -> Path:
    """$DTRAIN_CONFIGS_DIR if set, else the `train_configs` folder beside the `dtrain` package (the repo root)."""
    if env.get(ENV_CONFIGS_DIR):
        return Path(env[ENV_CONFIGS_DIR]).expanduser()
    return Path(__file__).resolve().parents[2] / "train_configs"


def available_config_names(configs_dir: Path) -> list[str]:
    """The config names (file stems) in `configs_dir`, sorted; empty when the folder is missing."""
    if not configs_dir.is_dir():
        return []
    return sorted(p.stem for p in configs_dir.glob("*.toml") if p.is_file())


def resolve_config_file(name: str, configs_dir: Path) -> Path:
    """The absolute path of the TOML file that `name` (a path, or a name in `configs_dir`) refers to."""
    if not name:
        raise ConfigError(f"empty config name; give a config name or a .toml path ({_listing(configs_dir)})")
    given = Path(name).expanduser()
    if given.is_file():
        return given.resolve()
    if given.is_dir():
        raise ConfigError(f"config {name} is a directory; give a .toml file or a config name in {configs_dir}")
    if os.sep not in name and "/" not in name:  # a bare name, looked up in the configs folder
        candidate = configs_dir / (name if name.endswith(".toml") else f"{name}.toml")
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(f"config file {name!r} not found ({_listing(configs_dir)})")


def _listing(configs_dir: Path) -> str:
    """What a not-found error says about the configs folder: its path and the names available there."""
    names = available_config_names(configs_dir)
    return f"configs folder {configs_dir}: " + (f"available: {', '.join(names)}" if names else "no .toml files")


def apply_toml(cfg: JobConfig, data: Mapping[str, Any], source: str) -> None:
    """Overlay parsed TOML `data` onto `cfg`, checking every key and value; `source` names the file in errors."""
    where = f" in {source}"
    for section, table in data.items():
        if not isinstance(table, dict):
            # A key outside any [section] table.
            raise ConfigError(unknown_key_message(section, where))
        _apply_table(cfg, section, table, source)


def _apply_table(cfg: JobConfig, section: str, table: Mapping[str, Any], source: str) -> None:
    """Overlay the TOML table of `section`; a table inside it is a nested section (``[quantize.linear.float8]``)
    unless the schema has a table-valued key of that name (``[model.args]``)."""
    where = f" in {source}"
    if section not in section_classes():
        raise ConfigError(
            unknown_key_message(f"{section}.{next(iter(table))}", where)
            if table
            else unknown_section_message(section, where)
        )
    for key, value in table.items():
        spec = config_fields().get(f"{section}.{key}")
        if spec is not None:
            setattr(section_of(cfg, section), key, coerce_value(spec, value, source))
        elif isinstance(value, dict):  # a nested section; an unknown one is reported by its first key
            _apply_table(cfg, f"{section}.{key}", value, source)
        else:
            raise ConfigError(unknown_key_message(f"{section}.{key}", where))


def load_config(
    argv: Sequence[str], env: Mapping[str, str] = os.environ, configs_dir: Path | None = None
) -> JobConfig:
    """Build the run's JobConfig from the command line; raises ConfigError (one line) on any problem.

    Precedence: dataclass defaults < the TOML file < command-line flags. `configs_dir` defaults to
    `default_configs_dir(env)`. `-h/--help` is ignored here (see `help_requested`), so that `--config X --help`
    can show X's values as the defaults.
    """
    parsed = parse_argv(argv)
    name = parsed.config if parsed.config is not None else (env.get(ENV_CONFIG_FILE) or DEFAULT_CONFIG_NAME)
    path = resolve_config_file(name, configs_dir if configs_dir is not None else default_configs_dir(env))

    cfg = JobConfig()
    apply_toml(cfg, read_toml(path), str(path))
    for spec, value in parsed.overrides:
        if spec.kind == "table":  # one entry per flag: merged into what the TOML file gave
            value = {**getattr(section_of(cfg, spec.section), spec.name), **value}
        setattr(section_of(cfg, spec.section), spec.name, value)
    cfg.job.config_file = str(path)
    # Store the schedule in its canonical spelling so that code downstream can compare names exactly.
    cfg.parallelism.pipeline_parallel_schedule = (
        canonical_schedule(cfg.parallelism.pipeline_parallel_schedule) or cfg.parallelism.pipeline_parallel_schedule
    )
    validate_config(cfg)
    return cfg
