"""The trainer's view of the parallel layout: what the step and the loop need from parallelize, in one object."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from dtrain.config.schema import JobConfig
from dtrain.distributed import World
from dtrain.errors import ConfigError

logger = logging.getLogger("dtrain")


@dataclass
class Layout:
    """How this rank's model is laid out and how the step reduces over data-parallel ranks."""

    dp_rank: int = 0
    dp_size: int = 1
    rng_coords: tuple = ()
    compute_dtype: torch.dtype = torch.float32
    reduce_over_dp: Callable[[torch.Tensor], torch.Tensor] = field(default=lambda t: t)
    loss_context: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)

    def parallelize(self, model: nn.Module) -> nn.Module:
        return model

    def init_weights(self, model: nn.Module, seed: int) -> None:
        model.init_weights()

    def local_metrics(self, metrics: dict) -> dict:
        """Step metrics as plain local tensors for the logger (DTensors are made whole here)."""
        return metrics

    def describe(self) -> str:
        return "1 process"

    def log_memory(self, state) -> None:
        return None


def check_layout(cfg: JobConfig, world_size: int, model_args) -> None:
    """Refuse a layout that cannot run, before any process group exists."""
    if world_size > 1:
        raise ConfigError("several processes need the parallelize package, which is not wired yet")


def build_layout(cfg: JobConfig, world: World, model_args) -> Layout:
    """The layout for this world."""
    return Layout()
