"""Optimizer construction: AdamW/Adam with weight decay only on matrices, and the fastest kernel the device has."""

from __future__ import annotations

import torch
from torch import nn

from dtrain.config.schema import Optimizer as OptimizerConfig


def param_groups(model_parts: list[nn.Module], weight_decay: float) -> list[dict]:
    """Two groups: matrices and embeddings decay; norms, biases and other vectors do not (standard LLM practice)."""
    decay, no_decay = [], []
    for part in model_parts:
        for param in part.parameters():
            if param.requires_grad:
                (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def kernel_flags(implementation: str, device: torch.device) -> dict:
    """torch.optim flags for the configured kernel. `auto` = fused on CUDA, foreach elsewhere.

    Fused Adam exists for CPU too, but foreach is the CPU default because fused does not support every
    parameter type (e.g. DTensors on CPU) on all torch versions we support.
    """
    if implementation == "auto":
        implementation = "fused" if device.type == "cuda" else "foreach"
    return {
        "fused": {"fused": True},
        "foreach": {"foreach": True},
        "for-loop": {"foreach": False, "fused": False},
    }[implementation]


def build_optimizer(model_parts: list[nn.Module], cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    """The configured optimizer over every trainable parameter of `model_parts`."""
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    groups = param_groups(model_parts, cfg.weight_decay)
    return cls(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **kernel_flags(cfg.implementation, device),
    )
