"""Learning-rate schedule: torchtitan v0.2.2's linear warmup, stable phase and decay (WSD when decay_ratio is set).

The formula is torchtitan's, step for step (tests/reference/test_torchtitan_optim_schedule.py compares the two), so
a torchtitan TOML file gives its learning-rate curve here.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class ScheduleConfig(Protocol):
    """The keys of the [lr_scheduler] config section that the schedule reads (the step does not import the config)."""

    warmup_steps: int
    decay_ratio: float | None
    decay_type: str
    min_lr_factor: float
    total_steps: int | None


def lr_factor(step: int, total_steps: int, cfg: ScheduleConfig) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based) of a schedule of `total_steps`.

    Warmup rises as (step + 1) / warmup_steps, so its last step is at the peak; warmup longer than the schedule is
    cut to it. Decay spans the last `decay_ratio` of the steps (all steps after warmup when unset) and goes from 1
    to `min_lr_factor`, reaching it one step past the schedule: as in torchtitan, the last step trained still
    learns. Steps past that (a run longer than lr_scheduler.total_steps) stay at the final rate.
    """
    warmup = min(cfg.warmup_steps, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = total_steps - warmup
    if cfg.decay_ratio is not None:
        decay_steps = min(round(total_steps * cfg.decay_ratio), decay_steps)
    # The stable phase holds one virtual step more than the run has (torchtitan's `total_steps + 1`).
    decay_start = total_steps + 1 - decay_steps
    if step < decay_start or decay_steps == 0:
        return 1.0
    progress = min((step + 1 - decay_start) / decay_steps, 1.0)
    if cfg.decay_type == "linear":
        remaining = 1 - progress
    elif cfg.decay_type == "sqrt":
        remaining = 1 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1 - cfg.min_lr_factor) * remaining


def build_lr_scheduler(optimizer: torch.optim.Optimizer, training_steps: int, cfg: ScheduleConfig):
    """A LambdaLR over `lr_factor`; its state_dict (last_epoch) is all that resume needs. The schedule spans
    `cfg.total_steps`, or the run's `training_steps` when that is unset."""
    span = cfg.total_steps if cfg.total_steps is not None else training_steps
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, span, cfg))
