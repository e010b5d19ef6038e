"""Configuration: the typed schema, loading (defaults < TOML < CLI), validation, --help and TOML output."""

from dtrain.config.cli import help_requested
from dtrain.config.fields import FieldSpec, config_fields
from dtrain.config.help import format_help
from dtrain.config.loader import default_configs_dir, load_config, resolve_config_file
from dtrain.config.schema import (
    ActivationCheckpoint,
    Checkpoint,
    Debug,
    Job,
    JobConfig,
    LRScheduler,
    Model,
    Optimizer,
    Parallelism,
    Training,
)
from dtrain.config.schema_observe import Compile, Metrics, Profiling
from dtrain.config.toml_io import config_to_dict, to_toml
from dtrain.config.validate import PIPELINE_SCHEDULES, validate_config

__all__ = [
    "ActivationCheckpoint",
    "Checkpoint",
    "Compile",
    "Debug",
    "FieldSpec",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "PIPELINE_SCHEDULES",
    "Parallelism",
    "Profiling",
    "Training",
    "config_fields",
    "config_to_dict",
    "default_configs_dir",
    "format_help",
    "help_requested",
    "load_config",
    "resolve_config_file",
    "to_toml",
    "validate_config",
]
