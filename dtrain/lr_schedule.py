"""Learning-rate schedule: linear warmup, an optional stable phase, then decay (WSD when decay_ratio is set)."""

from __future__ import annotations

import math

import torch

from dtrain.config.schema import LRScheduler


def lr_factor(step: int, total_steps: int, cfg: LRScheduler) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based) of `total_steps`.

    Warmup rises linearly to 1 over `warmup_steps` (starting above 0 so the first step learns something). With
    `decay_ratio` unset, decay starts right after warmup; otherwise the last `decay_ratio` of the steps decay and
    the steps between are stable (warmup-stable-decay). Decay goes from 1 to `min_lr_factor`.
    """
    warmup = min(cfg.warmup_steps, total_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.decay_ratio is None:
        decay_steps = total_steps - warmup
    else:
        decay_steps = min(round(total_steps * cfg.decay_ratio), total_steps - warmup)
    decay_start = total_steps - decay_steps
    if step < decay_start or decay_steps <= 0:
        return 1.0
    progress = min((step - decay_start + 1) / decay_steps, 1.0)
    if cfg.decay_type == "linear":
        remaining = 1.0 - progress
    elif cfg.decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * remaining


def build_lr_scheduler(optimizer: torch.optim.Optimizer, training_steps: int, cfg: LRScheduler):
    """A LambdaLR over `lr_factor`; its state_dict (last_epoch) is all that resume needs. The schedule spans
    `cfg.total_steps`, or the run's `training_steps` when that is unset."""
    span = cfg.total_steps if cfg.total_steps is not None else training_steps
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, span, cfg))
