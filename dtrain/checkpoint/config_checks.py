"""Checks of the [checkpoint] section that can run before any process group or run directory exists, and of what a
resume may change against the checkpoint it continues: never the model (family, flavor's resolved args), nor the
sequence length or global batch while the data position loads (docs/checkpointing.md, "What a resume may change",
says why)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dtrain.config.low_bit_optim import low_bit_format
from dtrain.config.schema import Checkpoint, Model
from dtrain.config.values import show_value
from dtrain.errors import ConfigError, DtrainError
from dtrain.parallelize import get_family

if TYPE_CHECKING:
    from dtrain.checkpoint.context import RunContext
    from dtrain.checkpoint.folders import CommitRecord

logger = logging.getLogger("dtrain")

# Parts of the TrainState a resume may skip; the model and the step counters are what a checkpoint is.
EXCLUDABLE_PARTS = ("optimizer", "lr_scheduler", "dataloader")


def check_checkpoint_config(c: Checkpoint, optimizer_name: str, world_size: int) -> None:
    """Raise a one-line ConfigError for the first [checkpoint] setting that cannot work for this world size (or
    for `optimizer.name`)."""
    if c.async_mode == "async_with_pinned_mem" and not torch.cuda.is_available():
        raise ConfigError(
            "checkpoint.async_mode = async_with_pinned_mem needs CUDA (it stages into pinned host memory for "
            "device-to-host copies); use async_mode = async on this machine"
        )
    if c.enable and c.async_mode != "disabled" and low_bit_format(optimizer_name) is not None:
        # DCP's async stager copies every tensor through new_empty, which torchao's quantized states lack.
        raise ConfigError(
            f"checkpoint.async_mode = {c.async_mode} cannot stage the quantized state of optimizer.name = "
            f"{optimizer_name} (torchao's tensors lack new_empty); use checkpoint.async_mode = disabled"
        )
    for part in c.exclude_from_loading:
        if part not in EXCLUDABLE_PARTS:
            raise ConfigError(
                f"checkpoint.exclude_from_loading may list {', '.join(EXCLUDABLE_PARTS)}; got {part!r}"
            )
    if not c.folder or Path(c.folder).is_absolute() or ".." in Path(c.folder).parts:
        raise ConfigError(
            f"checkpoint.folder must be a relative folder inside job.dump_folder (e.g. checkpoint); got {c.folder!r}"
        )
    if c.initial_load_in_hf and not c.initial_load_model_only:
        raise ConfigError(
            "checkpoint.initial_load_in_hf loads weights only; set checkpoint.initial_load_model_only = true"
        )
    if c.initial_load_partial and (c.initial_load_in_hf or not c.initial_load_model_only):
        # A Hugging Face folder's config.json must describe this model; a whole state's optimizer fits one model.
        raise ConfigError(
            "checkpoint.initial_load_partial loads the weights of a DCP checkpoint only; set "
            "checkpoint.initial_load_model_only = true and checkpoint.initial_load_in_hf = false"
        )
    if c.initial_load_in_hf and c.initial_load_writer != "auto":
        raise ConfigError(
            f"checkpoint.initial_load_writer = {c.initial_load_writer} is for DCP checkpoints; with "
            "checkpoint.initial_load_in_hf set it to auto"
        )
    if c.initial_load_path and not Path(c.initial_load_path).exists():
        raise ConfigError(f"checkpoint.initial_load_path {c.initial_load_path} does not exist")
    if c.last_save_in_hf and not c.last_save_model_only:
        # A Hugging Face folder holds weights only (as torchtitan refuses it too): the full state would be lost.
        raise ConfigError(
            "checkpoint.last_save_in_hf saves the weights only; set checkpoint.last_save_model_only = true, or "
            "checkpoint.last_save_in_hf = false for a full last save"
        )
    if c.load_only and c.create_seed_checkpoint:
        raise ConfigError(
            "checkpoint.create_seed_checkpoint saves a checkpoint, checkpoint.load_only never does: set one of them "
            "to false"
        )
    if c.create_seed_checkpoint and world_size != 1:
        raise ConfigError(
            f"checkpoint.create_seed_checkpoint runs in one process (got {world_size}); run it with NPROC=1, "
            "then start the real run on any layout"
        )


def model_record(model: Model, model_args: Any) -> dict[str, Any]:
    """What a checkpoint records of the model it holds: family, flavor and every resolved arg, as JSON values (so
    that the record read back compares equal); empty without model args (tests, tools)."""
    if not dataclasses.is_dataclass(model_args):
        return {}
    args = json.loads(json.dumps(dataclasses.asdict(model_args), default=str))
    return {"name": model.name, "flavor": model.flavor, "args": args}


def check_resume_changes(ctx: RunContext, path: Path, record: CommitRecord) -> None:
    """Refuse in one line what this resume changed against checkpoint `path` that it cannot continue (the module
    docstring says what and why); log what it continues despite a change."""
    _check_same_model(path, record.model, model_record(ctx.model, ctx.model_args))
    if record.model_only or not record.data:
        return  # weights only: no data position to continue
    saved, now, t = record.data, ctx.data_layout(), ctx.training
    changes = []
    if saved.get("seq_len") != now["seq_len"]:
        changes.append((f"training.seq_len = {now['seq_len']}", saved.get("seq_len"), "sequences of that length",
                        f"training.seq_len = {saved.get('seq_len')}"))
    if saved.get("global_batch") != now["global_batch"]:
        batch = (
            "training.global_batch_size" if t.global_batch_size > 0
            else f"training.local_batch_size {t.local_batch_size} x {now['dp_size']} data-parallel rank(s)"
        )
        changes.append((f"the global batch ({batch}) of {now['global_batch']} sequences", saved.get("global_batch"),
                        "batches of that size", f"training.global_batch_size = {saved.get('global_batch')} (any "
                        "training.local_batch_size that divides it continues exactly)"))
    for what, old, unit, keep in changes:
        if "dataloader" in ctx.checkpoint.exclude_from_loading:
            logger.info(
                f"checkpoint: {what} differs from checkpoint {path}'s {old}: weights, optimizer and schedule "
                "continue, the data starts from its beginning (checkpoint.exclude_from_loading = dataloader)"
            )
            continue
        raise DtrainError(
            f"{what} differs from checkpoint {path}'s {old}: its data position counts {unit} and cannot continue; "
            f"resume with {keep}, or set checkpoint.exclude_from_loading = [\"dataloader\"] to continue the weights, "
            "optimizer and schedule with the data from its beginning, or start a new job.dump_folder"
        )


def changed_model_args(saved: dict[str, Any], now: dict[str, Any], also_free: tuple[str, ...] = ()) -> list[str]:
    """The model.args keys whose values differ between two model records (`model_record`) of one family, but the
    args that are the run's to choose (the family's RUN_FIELDS: they change no weight) and `also_free`."""
    free = (*get_family(now["name"]).model.hf_adapter.RUN_FIELDS, *also_free)
    old_args, new_args = saved["args"], now["args"]
    return [k for k in {**old_args, **new_args} if k not in free and old_args.get(k) != new_args.get(k)]


def _check_same_model(path: Path, saved: dict[str, Any], now: dict[str, Any]) -> None:
    if not saved or not now:
        return
    new_run = (
        f"or start a new run in a new job.dump_folder from its weights (checkpoint.initial_load_path = {path}; "
        "checkpoint.initial_load_partial = true loads only the weights both models have)"
    )
    if saved["name"] != now["name"]:
        raise DtrainError(
            f"model.name = {now['name']} differs from checkpoint {path}'s {saved['name']}: a resume continues the "
            f"same model; set model.name = {saved['name']} (model.flavor = {saved['flavor'] or 'none'}), {new_run}"
        )
    # tie_word_embeddings is load_checks.check_tying's to refuse, naming its own key.
    changed = changed_model_args(saved, now, also_free=("tie_word_embeddings",))
    old_args, new_args = saved["args"], now["args"]
    via = f" (model.flavor {saved['flavor'] or 'none'} -> {now['flavor'] or 'none'})"
    via = via if saved["flavor"] != now["flavor"] else ""
    if changed:
        key = changed[0]
        old, new = show_value(old_args.get(key)), show_value(new_args.get(key))
        more = f" (as do {', '.join(f'model.args.{k}' for k in changed[1:])})" if len(changed) > 1 else ""
        keep = f"model.flavor = {saved['flavor'] or 'none'}" if via else f"model.args.{key} = {old}"
        raise DtrainError(
            f"model.args.{key} = {new}{via} differs from checkpoint {path}'s {old}{more}: a resume continues the "
            f"same model; set {keep}, {new_run}"
        )
    if via:
        logger.info(f"checkpoint: model.flavor {saved['flavor']} -> {now['flavor']} resolves to the same model args")


# What the data-layout keys added after the first release were, for checkpoints that predate them.
LAYOUT_DEFAULTS = {"dataset_mixture": [], "dataset_shuffle": True}


def check_data_layout(ctx: RunContext, path: Path, record: CommitRecord) -> None:
    """Refuse a data position that would not continue exactly; log when it carries over to a new dp size."""
    saved, now = record.data, ctx.data_layout()
    if not saved:
        return
    # Records written before a key existed hold its default.
    saved = {**LAYOUT_DEFAULTS, **saved}
    changed = [k for k in now if k != "dp_size" and saved.get(k) != now[k]]
    if changed:
        diffs = ", ".join(f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in changed)
        raise DtrainError(
            f"checkpoint {path}: its data position cannot continue exactly ({diffs}); keep them, or set "
            'checkpoint.exclude_from_loading = ["dataloader"] to start the data from the beginning'
        )
    if saved.get("dp_size") != now["dp_size"]:
        logger.info(
            f"checkpoint: data position carries over from {saved.get('dp_size')} to {now['dp_size']} data-parallel "
            f"rank(s) (global batch of {now['global_batch']} sequences unchanged)"
        )
