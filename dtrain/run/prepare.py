"""Everything about a run that can be checked before any process group or run directory exists.

`prepare` resolves the model family, tokenizer, model hyperparameters and parallel degrees for the coming world
size, raising a one-line DtrainError on the first problem; the trainer then starts from what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dtrain.checkpoint.config_checks import check_checkpoint_config
from dtrain.config.converters import FLOAT8_NAMES, MX_NAMES
from dtrain.config.fault_tolerance_checks import check_replica_launch
from dtrain.config.schema import Checkpoint, JobConfig, Model, Parallelism
from dtrain.data import Tokenizer, build_tokenizer
from dtrain.data.dataloader import check_training_data
from dtrain.errors import ConfigError
from dtrain.metrics.sinks import check_wandb_installed
from dtrain.models import ModelFamily
from dtrain.models.decoder import DecoderArgs
from dtrain.parallelize import FamilySpec, get_family
from dtrain.parallelize.pipeline_plan import SPLIT_BACKWARD_SCHEDULES
from dtrain.parallelize.torch_compat import MXFP8_TRAINING_SUPPORTED, SPLIT_BACKWARD_RUNS_CUSTOM_FUNCTIONS
from dtrain.precision.lora import check_lora_layout
from dtrain.reliability.run_folder_checks import check_run_folder
from dtrain.run.hf_start import HFStart, hf_start
from dtrain.run.layout import check_layout
from dtrain.run.model_args import apply_overrides, base_args, shape_table, typed_overrides
from dtrain.run.validation import build_source_for_validation, check_not_training_data, validation_data
from dtrain.run.world import world_size_from_env


@dataclass(frozen=True)
class Prepared:
    family: FamilySpec
    tokenizer: Any
    model_args: DecoderArgs


def model_args(
    cfg: JobConfig, family: ModelFamily, tokenizer_vocab: int, start: HFStart | None = None
) -> DecoderArgs:
    """The model's hyperparameters: the flavor's with the `[model.args]` overrides (the vocabulary too, as in
    torchtitan, or sized for the tokenizer with model.vocab_size_from_tokenizer) and room for seq_len (training's
    and validation's); or, when the run starts from a Hugging Face checkpoint with a config.json (`start`), that
    config's, which nothing may contradict. A vocabulary smaller than the tokenizer's is refused: ids past the
    embedding would fail inside the first forward."""
    overrides = typed_overrides(family, cfg.model.args)
    if start is not None:
        base, vocab_size = _agreeing_with(start, overrides, cfg.model.tie_word_embeddings), start.args.vocab_size
        if vocab_size < tokenizer_vocab:
            raise ConfigError(
                f"{start.source} has vocab_size {vocab_size}, fewer than the tokenizer's {tokenizer_vocab} tokens "
                "(model.hf_assets_path should hold this checkpoint's tokenizer)"
            )
    else:
        base = base_args(family, cfg.model.flavor, overrides)
        vocab_size = base.vocab_size
        if cfg.model.vocab_size_from_tokenizer and "vocab_size" not in overrides:
            multiple = cfg.model.vocab_size_multiple_of
            vocab_size = -(-tokenizer_vocab // multiple) * multiple
        if vocab_size < tokenizer_vocab:
            where = (
                f"model.args.vocab_size={vocab_size} is" if "vocab_size" in overrides
                else f"model.flavor '{cfg.model.flavor}' has vocab_size {vocab_size},"
            )
            raise ConfigError(
                f"{where} smaller than the tokenizer's {tokenizer_vocab} tokens (valid: model.args.vocab_size >= "
                f"{tokenizer_vocab}, or model.vocab_size_from_tokenizer = true)"
            )
    tie = base.tie_word_embeddings if cfg.model.tie_word_embeddings is None else cfg.model.tie_word_embeddings
    seq_len = max(cfg.training.seq_len, cfg.validation.seq_len if cfg.validation.enable else 0)
    return apply_overrides(
        family, base, dict(vocab_size=vocab_size, max_seq_len=max(base.max_seq_len, seq_len), tie_word_embeddings=tie)
    )


def _agreeing_with(start: HFStart, overrides: dict[str, Any], tie: bool | None) -> DecoderArgs:
    """The config.json's shape, after checking that no explicit setting says otherwise, with the settings that are
    the run's to choose (the adapter's RUN_FIELDS: max_seq_len, a MoE's balancing) as given."""
    run_fields = start.family.model.hf_adapter.RUN_FIELDS
    for name, value in overrides.items():
        if name not in run_fields and getattr(start.args, name) != value:
            raise ConfigError(
                f"model.args.{name}={value} contradicts {start.source}, which has {getattr(start.args, name)}"
            )
    if tie is not None and tie != start.args.tie_word_embeddings:
        raise ConfigError(
            f"model.tie_word_embeddings={str(tie).lower()} contradicts {start.source}, which has "
            f"tie_word_embeddings {str(start.args.tie_word_embeddings).lower()}"
        )
    return apply_overrides(start.family.model, start.args, {k: v for k, v in overrides.items() if k in run_fields})


def model_family(cfg: JobConfig) -> tuple[FamilySpec, HFStart | None]:
    """The run's model family, and the Hugging Face config.json it starts from if any (which then decides family
    and shape); model.name becomes the family's name and, for such a start, model.flavor empty: the shape came
    from no flavor. Training, the estimator and the tools resolve it alike."""
    start = hf_start(cfg.checkpoint, cfg.model.name)
    try:
        family = start.family if start is not None else get_family(cfg.model.name)
    except ValueError as err:
        raise ConfigError(f"model.name: {err}") from None
    cfg.model.name = family.name
    if start is not None:
        cfg.model.flavor = ""
    return family, start


def model_description(m: Model, c: Checkpoint) -> str:
    """The model, as the lines that name it say: family and flavor, or, for a config with no flavor, where its
    shape comes from (the Hugging Face folder the run starts from, else [model.args], which then gives every
    field)."""
    if m.flavor:
        return f"{m.name} {m.flavor}"
    if c.initial_load_in_hf and c.initial_load_path:
        return f"{m.name} (from {c.initial_load_path})"
    return f"{m.name}, shape as given by model.args"


def check_hf_exportable(checkpoint: Checkpoint, family: FamilySpec, args: DecoderArgs) -> None:
    """A last save in Hugging Face's form is refused now, not after training, when that form cannot express this
    model (e.g. torchtitan's DeepSeek-V3 norm eps)."""
    if not (checkpoint.enable and checkpoint.last_save_in_hf):
        return
    try:
        family.model.hf_adapter(args).hf_config(torch.float32)
    except ValueError as err:
        raise ConfigError(f"checkpoint.last_save_in_hf: {err}") from None


def check_converters_on_this_torch(converters: list[str], parallelism: Parallelism) -> None:
    """float8 and MX training (`model.converters`) where this torch cannot run them: MX without the DTensor rules
    torchao's MXFP8 training needs, or either with a split-backward pipeline schedule (the config checks the
    rest)."""
    mx = any(name in MX_NAMES for name in converters)
    if mx and not MXFP8_TRAINING_SUPPORTED:
        raise ConfigError(
            f"model.converters = mx: torchao's MXFP8 training needs torch 2.13 (this is {torch.__version__})"
        )
    schedule = parallelism.pipeline_parallel_schedule
    split_backward = parallelism.pipeline_parallel_degree > 1 and schedule in SPLIT_BACKWARD_SCHEDULES
    low_precision = mx or any(name in FLOAT8_NAMES for name in converters)
    if low_precision and split_backward and not SPLIT_BACKWARD_RUNS_CUSTOM_FUNCTIONS:
        raise ConfigError(
            f"model.converters = {converters[0]} with parallelism.pipeline_parallel_schedule = {schedule} "
            f"needs torch 2.13 (torch {torch.__version__} cannot split the backward of low-precision matmuls); use "
            "1F1B, GPipe, Interleaved1F1B or LoopedBFS"
        )


def check_data(cfg: JobConfig, tokenizer: Tokenizer) -> None:
    """Training's and validation's data, as far as their sources can tell without training: refused here, before
    the run folder is touched (the loaders would find the same problems after the run folder is made and, at the
    first batch, after its config.toml, metrics and TensorBoard files are written)."""
    check_training_data(cfg.training, tokenizer, seed=cfg.debug.seed)
    if cfg.validation.enable:
        check_not_training_data(cfg.training, validation_data(cfg.validation, cfg.training))
        build_source_for_validation(cfg.validation, cfg.training, cfg.debug.seed, tokenizer)


def prepare(cfg: JobConfig) -> Prepared:
    """The run's family, tokenizer and model shape, after every check that needs no process group; reads the
    whole config: it assembles the run (and records the resolved shape in `cfg.model.args`)."""
    check_converters_on_this_torch(cfg.model.converters, cfg.parallelism)
    family, start = model_family(cfg)
    tokenizer = build_tokenizer(cfg.model)
    args = model_args(cfg, family.model, tokenizer.vocab_size, start)
    # The run's config.toml records the whole shape it trains, so that it rebuilds the same model by itself.
    cfg.model.args = shape_table(args)
    check_layout(cfg, world_size_from_env(), family, args)
    if cfg.lora.enable:
        lora_model = check_lora_layout(cfg.lora, family, args, cfg.parallelism.tensor_parallel_degree)
        if cfg.lora.quantize_base:
            from dtrain.precision.qlora import check_nf4_shapes  # torchao is imported only for QLoRA

            check_nf4_shapes(lora_model)
    check_checkpoint_config(cfg.checkpoint, cfg.optimizer.name, world_size_from_env())
    check_hf_exportable(cfg.checkpoint, family, args)
    check_wandb_installed(cfg.metrics.enable_wandb)
    check_replica_launch(cfg, torch.cuda.is_available())
    check_run_folder(cfg.job, cfg.checkpoint, cfg.metrics)
    check_data(cfg, tokenizer)
    return Prepared(family, tokenizer, args)
