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
from dtrain.config.evaluation import check_eval
from dtrain.config.fault_tolerance_checks import check_fault_tolerance
from dtrain.config.fields import config_fields, section_of
from dtrain.config.low_bit_optim import low_bit_format
from dtrain.config.preference import check_preference
from dtrain.config.schema import JobConfig
from dtrain.config.values import coerce_value, show_value
from dtrain.errors import ConfigError

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
    _check_lora(cfg)
    check_preference(cfg)
    check_fault_tolerance(cfg)
    check_eval(cfg)


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
        if any(entry.kind == "chat" for entry in parse_mixture(t.dataset_mixture, MIXABLE_KINDS)):
            raise ConfigError(
                "training.dataset_mixture cannot hold chat data (its sequences carry their own labels and documents); "
                "set training.dataset = chat to fine-tune on one chat dataset"
            )
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


def _check_initial_adapter(cfg: JobConfig) -> None:
    """lora.initial_adapter_path continues a PEFT adapter: on its base model, in a LoRA run (peft_import.py checks
    its settings and tensors against the run's when it loads)."""
    path = Path(cfg.lora.initial_adapter_path)
    if not cfg.lora.enable:
        raise ConfigError(f"lora.initial_adapter_path {path} needs lora.enable = true (and [lora] as it was trained)")
    if not cfg.checkpoint.initial_load_path:
        raise ConfigError(
            f"lora.initial_adapter_path {path} adapts a base model: set checkpoint.initial_load_path to that base "
            "(a Hugging Face folder with checkpoint.initial_load_in_hf = true, or a DCP checkpoint)"
        )
    if not (path / "adapter_config.json").is_file():
        raise ConfigError(f"lora.initial_adapter_path {path} is not a PEFT adapter folder (no adapter_config.json)")


# The layouts NF4 base weights are proven on (tests/parallelize/test_parity_lora.py): one process, and FSDP2.
QLORA_REFUSED_DEGREES = (
    "tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree", "data_parallel_replicate_degree",
)


def _check_qlora(cfg: JobConfig) -> None:
    """lora.quantize_base stores a base model's weights as NF4 once they are loaded (precision/qlora.py); its
    shapes are checked against NF4's blocks by the pre-flight."""
    if not cfg.lora.enable:
        raise ConfigError("lora.quantize_base needs lora.enable = true (it stores the LoRA linears' bases as NF4)")
    if not cfg.checkpoint.initial_load_path:
        raise ConfigError(
            "lora.quantize_base quantizes a base model: set checkpoint.initial_load_path to it (a Hugging Face folder "
            "with checkpoint.initial_load_in_hf = true, or a DCP checkpoint); the run's checkpoints then refer to it"
        )
    if cfg.checkpoint.last_save_in_hf:
        raise ConfigError(
            "checkpoint.last_save_in_hf with lora.quantize_base is not built (the run holds its base as NF4); set "
            "checkpoint.last_save_in_hf = false and convert the last checkpoint: scripts/convert_checkpoint.py to-peft "
            "(the adapters) or to-hf (merged into the full-precision base)"
        )
    p = cfg.parallelism
    for key in QLORA_REFUSED_DEGREES:
        if getattr(p, key) > 1:
            raise ConfigError(
                f"lora.quantize_base with parallelism.{key} = {getattr(p, key)} is not built (NF4 base weights are "
                "built for one process and FSDP2); shard with parallelism.data_parallel_shard_degree alone, or set "
                "lora.quantize_base = false"
            )


def _check_lora(cfg: JobConfig) -> None:
    """LoRA's own keys; its target modules are checked against the model by the pre-flight (precision/lora.py)."""
    lora = cfg.lora
    if lora.initial_adapter_path:
        _check_initial_adapter(cfg)
    if lora.quantize_base:
        _check_qlora(cfg)
    if not lora.enable:
        return
    if lora.dropout >= 1:
        raise ConfigError(f"lora.dropout must be in [0, 1); got {lora.dropout:g}")
    if lora.alpha == 0:
        # The adapters' updates are scaled by alpha / rank: at 0 every step trains nothing (grad norm 0).
        raise ConfigError("lora.alpha must be > 0 (updates are scaled by alpha / rank; 0 trains nothing); got 0")
    p = cfg.parallelism
    split = [f"parallelism.{key} = {getattr(p, key)}" for key in ("tensor_parallel_degree", "context_parallel_degree")
             if getattr(p, key) > 1]
    if lora.dropout > 0 and split:
        # Random streams are per data-parallel rank: the TP or CP ranks that split one sequence's features or tokens
        # would draw the same mask for each of their parts.
        raise ConfigError(
            f"lora.dropout > 0 with {split[0]} is not built (each rank's part of the features or tokens would draw "
            "the same dropout mask); set lora.dropout = 0 or train without tensor/context parallel"
        )
    if not lora.target_modules:
        raise ConfigError("lora.target_modules is empty; name the linears to adapt (e.g. wq,wk,wv,wo or all-linear)")
    if cfg.model.converters:
        raise ConfigError(
            f"lora.enable does not compose with model.converters = {cfg.model.converters[0]} (low-precision base "
            "linears); remove one of them"
        )
