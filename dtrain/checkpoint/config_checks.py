"""Checks of the [checkpoint] section that can run before any process group or run directory exists."""

from __future__ import annotations

from pathlib import Path

import torch

from dtrain.config.schema import Checkpoint
from dtrain.errors import ConfigError
from dtrain.precision.low_bit_optim import low_bit_format

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
