"""`load_config`: dataclass defaults, overlaid by a TOML file, overlaid by command-line flags, then validated.

A key given on the command line replaces the file's value before that value's choices and bounds are checked,
so a flag rescues a file whose value is not valid here (``--training.dataset builtin``); a value of the wrong type
is still reported, because the file itself is broken. ``model.name`` is checked first: a file for a family dtrain does not
have fails on that, not on some key of that family's. torchtitan's keys without a dtrain field are handled by
``torchtitan_keys.py``: renamed, accepted where they change nothing (named in one warning line), or refused.

Which TOML file: `--config NAME|PATH` (or `--job.config_file PATH`, torchtitan's spelling), else the CONFIG_FILE
environment variable, else `debug_model`. A path that exists is used as is; otherwise a bare name, with or without
`.toml`, is looked up in the configs folder (`train_configs/` at the repo root, or $DTRAIN_CONFIGS_DIR).
"""

from __future__ import annotations

import logging
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
from dtrain.config.torchtitan_keys import TORCHTITAN_ONLY, foreign_sections
from dtrain.config.validate import canonical_schedule, validate_config
from dtrain.config.values import coerce_value, show_value
from dtrain.errors import ConfigError

logger = logging.getLogger("dtrain")

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


# torchtitan keys without a dtrain field, as given: key -> (value, where it was given).
ForeignValues = dict[str, tuple[Any, str]]


def apply_toml(
    cfg: JobConfig,
    data: Mapping[str, Any],
    source: str,
    skip: frozenset[str] = frozenset(),
    foreign: ForeignValues | None = None,
) -> None:
    """Overlay parsed TOML `data` onto `cfg`, checking every key and value; `source` names the file in errors.
    Keys in `skip` (given on the command line) are not read; torchtitan-only keys are collected into `foreign`."""
    foreign = {} if foreign is None else foreign
    where = f" in {source}"
    for section, table in data.items():
        if not isinstance(table, dict):
            # A key outside any [section] table.
            raise ConfigError(unknown_key_message(section, where))
        _apply_table(cfg, section, table, source, skip, foreign)


def _apply_table(
    cfg: JobConfig, section: str, table: Mapping[str, Any], source: str, skip: frozenset[str], foreign: ForeignValues
) -> None:
    """Overlay the TOML table of `section`; a table inside it is a nested section (``[quantize.linear.float8]``)
    unless the schema has a table-valued key of that name (``[model.args]``)."""
    where = f" in {source}"
    known = section in section_classes()
    if not known and section not in foreign_sections():
        raise ConfigError(
            unknown_key_message(f"{section}.{next(iter(table))}", where)
            if table
            else unknown_section_message(section, where)
        )
    for key, value in table.items():
        name = f"{section}.{key}"
        spec = config_fields().get(name) if known else None
        if name in skip:
            # The command line gives this key: a file whose value has the wrong type is still broken and
            # reported, but a valid-looking value that this run cannot use (a dataset missing here) is not.
            if spec is not None:
                coerce_value(spec, value, source, constraints=False)
            continue
        if spec is not None:
            setattr(section_of(cfg, section), key, coerce_value(spec, value, source))
        elif name in TORCHTITAN_ONLY:
            foreign[name] = (value, source)
        elif isinstance(value, dict):  # a nested section; an unknown one is reported by its first key
            _apply_table(cfg, name, value, source, skip, foreign)
        else:
            raise ConfigError(unknown_key_message(name, where))


def check_model_name_first(data: Mapping[str, Any], overrides: list, source: str) -> None:
    """The family is checked before any other key: every other key's meaning depends on it."""
    spec = config_fields()["model.name"]
    from_cli = [value for key_spec, value in overrides if key_spec is spec]
    if from_cli:
        coerce_value(spec, from_cli[-1], None)
    elif isinstance(data.get("model"), dict) and "name" in data["model"]:
        coerce_value(spec, data["model"]["name"], source)


def apply_foreign(cfg: JobConfig, foreign: ForeignValues) -> list[str]:
    """Apply the torchtitan-only keys: renamed ones set their dtrain key, inert ones are returned (to be named in
    one warning line), any other value is a one-line ConfigError that says why."""
    inert = []
    for name, (value, source) in foreign.items():
        meaning = TORCHTITAN_ONLY[name]
        if meaning.alias is not None:
            section, _, key = meaning.alias.rpartition(".")
            setattr(section_of(cfg, section), key, coerce_value(config_fields()[meaning.alias], value, source))
        elif meaning.accepts(value):
            inert.append(name)
        else:
            valid = ", ".join(show_value(v) for v in meaning.inert)
            where = f" (in {source})" if source else ""
            raise ConfigError(
                f"{name} = {show_value(value)} is not supported: {meaning.reason} (valid: {valid}){where}"
            )
    return inert


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

    data = read_toml(path)
    check_model_name_first(data, parsed.overrides, str(path))
    cfg = JobConfig()
    foreign: ForeignValues = {}
    on_command_line = frozenset(spec.key for spec, _ in parsed.overrides if spec.kind != "table")
    apply_toml(cfg, data, str(path), skip=on_command_line | set(parsed.foreign), foreign=foreign)
    foreign.update({name: (value, "") for name, value in parsed.foreign.items()})
    inert = apply_foreign(cfg, foreign)
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
    if inert:
        logger.warning(
            "torchtitan keys with no effect in dtrain, accepted: %s (docs/migrating-from-torchtitan.md)",
            ", ".join(sorted(inert)),
        )
    return cfg
