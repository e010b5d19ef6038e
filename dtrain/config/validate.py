"""Checks of a JobConfig that need nothing but the config itself (no world size, no devices, no files).

`validate_config` first re-checks every field's type, choices and minimum (a config built or edited in Python never
went through the loader), then the rules that involve one field's meaning or several fields. Checks that need
the world size (parallel degrees, divisibility by the data-parallel size) belong to mesh construction.
"""

from __future__ import annotations

import os
from pathlib import Path

from dtrain.config.converters import check_converters
from dtrain.config.dataset_mixture import MIXABLE_KINDS, parse_mixture
from dtrain.config.fields import config_fields, section_of
from dtrain.config.schema import JobConfig
from dtrain.config.values import coerce_value, show_value
from dtrain.errors import ConfigError
from dtrain.precision.low_bit_optim import low_bit_format

# Pipeline schedules by the names torch.distributed.pipelining knows them; matched case-insensitively.
PIPELINE_SCHEDULES = (
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
)
COMPILE_COMPONENTS = ("model", "loss")


def canonical_schedule(name: str) -> str | None:
    """The canonical spelling of a pipeline schedule name given in any case, or None when it is not one."""
    return {s.lower(): s for s in PIPELINE_SCHEDULES}.get(name.lower())


def validate_config(cfg: JobConfig) -> None:
    """Raise a one-line ConfigError naming the key(s) of the first problem found; return None when valid."""
    _check_fields(cfg)
    _check_training(cfg)
    _check_optimizer_and_schedule(cfg)
    _check_parallelism(cfg)
    _check_activation_checkpoint_and_compile(cfg)
    _check_data_and_tokenizer(cfg)
    _check_validation(cfg)
    _check_profiling(cfg)
    check_converters(cfg)


def _check_fields(cfg: JobConfig) -> None:
    for spec in config_fields().values():
        coerce_value(spec, getattr(section_of(cfg, spec.section), spec.name))


def _check_training(cfg: JobConfig) -> None:
    t = cfg.training
    if t.global_batch_size == 0 or (t.global_batch_size > 0 and t.global_batch_size % t.local_batch_size):
        raise ConfigError(
            f"training.global_batch_size must be -1 or a positive multiple of training.local_batch_size "
            f"({t.local_batch_size}); got {t.global_batch_size}"
        )
    if not cfg.job.dump_folder:
        raise ConfigError("job.dump_folder must not be empty (it is the run directory; e.g. ./outputs)")
    saved = cfg.job.save_config_file
    if saved is not None and (not saved or os.path.isabs(saved) or ".." in Path(saved).parts):
        raise ConfigError(
            f"job.save_config_file must be a file name inside job.dump_folder (e.g. config.json); got {saved!r}"
        )
    if cfg.debug.deterministic_warn_only and not cfg.debug.deterministic:
        raise ConfigError("debug.deterministic_warn_only only applies with debug.deterministic = true")


def _check_optimizer_and_schedule(cfg: JobConfig) -> None:
    for name in ("beta1", "beta2"):
        value = getattr(cfg.optimizer, name)
        if value >= 1:
            raise ConfigError(f"optimizer.{name} must be in [0, 1); got {value}")
    if low_bit_format(cfg.optimizer.name) is not None and cfg.optimizer.implementation != "auto":
        raise ConfigError(
            f"optimizer.implementation = {cfg.optimizer.implementation} applies to torch's AdamW and Adam only; "
            f"torchao's {cfg.optimizer.name} compiles its own step: leave optimizer.implementation auto"
        )
    ratio = cfg.lr_scheduler.decay_ratio
    if ratio is not None and ratio > 1:
        raise ConfigError(f"lr_scheduler.decay_ratio must be in [0, 1] (or unset); got {ratio:g}")
    if cfg.lr_scheduler.min_lr_factor > 1:
        raise ConfigError(f"lr_scheduler.min_lr_factor must be in [0, 1]; got {cfg.lr_scheduler.min_lr_factor:g}")


def _check_parallelism(cfg: JobConfig) -> None:
    p = cfg.parallelism
    if p.data_parallel_shard_degree == 0:
        # The schema's minimum is -1 (automatic), which lets 0 through; 0 shards is never meaningful.
        raise ConfigError("parallelism.data_parallel_shard_degree must be -1 (automatic) or a positive integer; got 0")
    if canonical_schedule(p.pipeline_parallel_schedule) is None:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule must be one of {', '.join(PIPELINE_SCHEDULES)}; "
            f"got {show_value(p.pipeline_parallel_schedule)}"
        )
    if p.pipeline_parallel_degree > 1 and cfg.training.local_batch_size % p.pipeline_parallel_microbatch_size:
        raise ConfigError(
            f"training.local_batch_size ({cfg.training.local_batch_size}) must be a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size ({p.pipeline_parallel_microbatch_size})"
        )
    if p.expert_tensor_parallel_degree != 1:
        raise ConfigError(
            f"parallelism.expert_tensor_parallel_degree = {p.expert_tensor_parallel_degree} is not supported: "
            "splitting each routed expert over tensor-parallel ranks is not built (valid: 1, where every TP rank "
            "keeps whole experts, or its expert-parallel share of them)"
        )
    if p.enable_async_tensor_parallel and not (cfg.compile.enable and "model" in cfg.compile.components):
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel needs compile.enable = true with model in compile.components"
        )


def _check_activation_checkpoint_and_compile(cfg: JobConfig) -> None:
    option = cfg.activation_checkpoint.selective_ac_option
    if option != "op" and not (option.isascii() and option.isdigit() and int(option) > 0):
        raise ConfigError(
            f"activation_checkpoint.selective_ac_option must be a positive integer (as a string) or op; "
            f"got {show_value(option)}"
        )
    for component in cfg.compile.components:
        if component not in COMPILE_COMPONENTS:
            raise ConfigError(
                f"compile.components may contain {', '.join(COMPILE_COMPONENTS)}; got {show_value(component)}"
            )
    debug_dir = cfg.compile.debug_dir
    if debug_dir and (Path(debug_dir).is_absolute() or ".." in Path(debug_dir).parts):
        raise ConfigError(
            "compile.debug_dir must be a relative folder inside job.dump_folder (e.g. compile_debug); "
            f"got {debug_dir!r}"
        )
    if debug_dir and cfg.compile.cache:
        raise ConfigError(
            "compile.debug_dir compiles the first step without caches (to generate the code it writes), so "
            "compile.cache would save nothing: set one of them"
        )


def _check_data_and_tokenizer(cfg: JobConfig) -> None:
    t = cfg.training
    if t.dataset in ("files", "hf", "tokens") and not t.dataset_path:
        raise ConfigError(f"training.dataset = {t.dataset} needs training.dataset_path")
    if t.dataset == "mixture":
        parse_mixture(t.dataset_mixture, MIXABLE_KINDS)
        if t.dataset_path:
            raise ConfigError(
                "training.dataset_path is not read with training.dataset = mixture: give each source's path in "
                "training.dataset_mixture and leave dataset_path empty"
            )
    elif t.dataset_mixture:
        raise ConfigError(
            f"training.dataset_mixture is set but training.dataset = {t.dataset}; set training.dataset = mixture to "
            "mix its sources, or remove it"
        )
    if cfg.model.tokenizer in ("hf", "tiktoken") and not cfg.model.hf_assets_path:
        raise ConfigError(
            f"model.tokenizer = {cfg.model.tokenizer} needs model.hf_assets_path (the folder or file holding it)"
        )


def _check_validation(cfg: JobConfig) -> None:
    v = cfg.validation
    if v.steps == 0:
        raise ConfigError("validation.steps must be -1 (the whole validation set) or a number of batches; got 0")
    if not v.enable:
        return
    if v.dataset not in MIXABLE_KINDS:
        raise ConfigError(
            f"validation.dataset must be one of {', '.join(MIXABLE_KINDS)}; got {show_value(v.dataset)}"
        )
    if v.dataset in ("files", "hf", "tokens") and not v.dataset_path:
        raise ConfigError(f"validation.dataset = {v.dataset} needs validation.dataset_path")
    if v.dataset == "synthetic" and v.steps == -1:
        raise ConfigError(
            "validation.steps = -1 evaluates the whole validation set, but validation.dataset = synthetic never "
            "ends; set validation.steps to a positive number of batches"
        )
    microbatch = cfg.parallelism.pipeline_parallel_microbatch_size
    if cfg.parallelism.pipeline_parallel_degree > 1 and v.local_batch_size % microbatch:
        raise ConfigError(
            f"validation.local_batch_size ({v.local_batch_size}) must be a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size ({microbatch})"
        )


def _check_profiling(cfg: JobConfig) -> None:
    p = cfg.profiling
    if p.enable_profiling and p.profiler_warmup + p.profiler_active > p.profile_freq:
        raise ConfigError(
            f"profiling.profiler_warmup + profiling.profiler_active ({p.profiler_warmup} + {p.profiler_active}) "
            f"must be <= profiling.profile_freq ({p.profile_freq})"
        )
