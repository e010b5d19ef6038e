"""Optimizer construction: AdamW/Adam with weight decay only on matrices, and the fastest kernel the device has."""

from __future__ import annotations

import collections

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


class _MergedState(collections.ChainMap):
    """The per-part optimizers' `state` dicts seen as one; `clear` empties all of them."""

    def clear(self) -> None:
        for part_state in self.maps:
            part_state.clear()


class OptimizersContainer(torch.optim.Optimizer):
    """One optimizer per model part, stepped as one.

    Pipeline stages (several parts per rank) need this: DCP's optimizer state-dict API takes one module per
    optimizer. A single part is the same thing with one member, so every layout takes one path.

    `Optimizer.__init__` is not called: it would build parameter groups of its own, while these must stay the
    parts' own group dicts (loading a state dict replaces them, and the LR schedule must reach the live ones).
    Step hooks (e.g. a checkpoint waiting for staging) are run here for the same reason.
    """

    def __init__(self, model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        self.model_parts = model_parts
        self.optimizers = optimizers
        self.defaults = optimizers[0].defaults
        self._optimizer_step_pre_hooks = collections.OrderedDict()
        self._optimizer_step_post_hooks = collections.OrderedDict()

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> _MergedState:
        return _MergedState(*(optimizer.state for optimizer in self.optimizers))

    def step(self, closure=None) -> None:
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        for optimizer in self.optimizers:
            optimizer.step()
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def build_optimizers(model_parts: list[nn.Module], cfg: OptimizerConfig, device: torch.device) -> OptimizersContainer:
    """The configured optimizer for each model part, as one container."""
    return OptimizersContainer(model_parts, [build_optimizer([part], cfg, device) for part in model_parts])
