"""Optimizer construction: torch's AdamW/Adam as torchtitan v0.2.2 builds them (one parameter group, every parameter
decayed; optionally no decay on vectors), with the fastest kernel the device has; or torchao's low-bit AdamW/Adam,
which keep the two moments quantized."""

from __future__ import annotations

import collections
import warnings
from typing import Protocol

import torch
from torch import nn

from dtrain.config.low_bit_optim import low_bit_format, quantizes
from dtrain.parallelize import local_shard
from dtrain.step.torchao_import import quiet_torchao_import

# torch 2.13 advises once per class that torchao's state tensors define _stable_hash_for_caching; its default hash
# of their inner tensors keys them correctly (the DTensor case is with_own_compile_cache_key's), so the advice is
# for torchao, not for someone reading a training log.
warnings.filterwarnings(
    "ignore", message="OptimState(8bit|4bit|Fp8) does not implement _stable_hash_for_caching", category=UserWarning
)


class OptimizerConfig(Protocol):
    """The keys of the [optimizer] config section that the optimizer reads (the step does not import the config)."""

    name: str
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    no_decay_on_vectors: bool
    implementation: str


def moment_bytes(name: str, param: torch.Tensor) -> int:
    """Bytes of the two Adam moments of this rank's shard of `param` under optimizer.name `name`, from its shape
    alone (so also on the meta device, before any state exists)."""
    local = local_shard(param)
    plain = 2 * local.numel() * local.element_size()
    fmt = low_bit_format(name)
    if fmt is None or not quantizes(fmt, local.numel()):
        return plain
    blocks = local.numel() // fmt.block_size
    return int(2 * (local.numel() * fmt.code_bytes + blocks * 4 + fmt.qmap_bytes))


def param_groups(model_parts: list[nn.Module], weight_decay: float, no_decay_on_vectors: bool) -> list[dict]:
    """One group that decays every trainable parameter (torchtitan's), or with `no_decay_on_vectors` two: matrices
    and embeddings decay, norms, biases and other vectors do not (Megatron's and nanoGPT's practice)."""
    params = [param for part in model_parts for param in part.parameters() if param.requires_grad]
    if not no_decay_on_vectors:
        return [{"params": params, "weight_decay": weight_decay}]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def param_grouping(cfg: OptimizerConfig) -> str:
    """The name of param_groups' layout under `cfg`, as checkpoints record it: "all" (one group, every parameter
    decayed) or "no_decay_on_vectors" (two groups)."""
    return "no_decay_on_vectors" if cfg.no_decay_on_vectors else "all"


def kernel_flags(implementation: str, device: torch.device) -> dict:
    """torch.optim flags for the configured kernel. `auto` = fused on CUDA, foreach elsewhere.

    Fused Adam exists for CPU too, but foreach is the CPU default because fused does not support every
    parameter type (e.g. DTensors on CPU) on all torch versions we support.
    """
    if implementation == "auto":
        implementation = "fused" if device.type == "cuda" else "foreach"
    # Both flags spelled out, as torchtitan passes them, so the optimizers' defaults are the same dicts.
    return {"fused": implementation == "fused", "foreach": implementation == "foreach"}


def build_optimizer(model_parts: list[nn.Module], cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    """The configured optimizer over every trainable parameter of `model_parts`."""
    groups = param_groups(model_parts, cfg.weight_decay, cfg.no_decay_on_vectors)
    hyperparameters = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    fmt = low_bit_format(cfg.name)
    if fmt is None:
        cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
        return cls(groups, **hyperparameters, **kernel_flags(cfg.implementation, device))
    # Imported only when asked for: torchao is a dependency, but importing it costs a second or more.
    with quiet_torchao_import():
        import torchao.optim

    # torchao's step is its own torch.compile'd code, so optimizer.implementation has no meaning here (the config
    # check refuses a value other than auto).
    optimizer = getattr(torchao.optim, cfg.name)(groups, **hyperparameters, block_size=fmt.block_size)
    return with_own_compile_cache_key(optimizer, cfg.name)


def with_own_compile_cache_key(optimizer: torch.optim.Optimizer, name: str) -> torch.optim.Optimizer:
    """`optimizer`, its step compiled under a cache key tag of its own, so that torch's on-disk compile caches keep
    each low-bit format's compiled step apart.

    torch 2.13 keys AOTAutograd's cache for a DTensor by its spec alone, not by the tensor subclass it wraps, so
    the steps of AdamW8bit, AdamW4bit and AdamWFp8 over the same FSDP2 parameters share one key: once one of them
    has run, the next loads the other's compiled step and fails on its first step ("wrong number of dimensions").
    DCP's state-dict code steps the part optimizer itself (to create its state before a load), so the tag is
    set around this optimizer's own step, not OptimizersContainer's.
    """
    step = optimizer.step
    tag = f"{torch.compiler.config.cache_key_tag}dtrain.step.optimizer.{name}"

    def step_with_own_key(closure=None):
        with torch.compiler.config.patch(cache_key_tag=tag):
            return step(closure)

    optimizer.step = step_with_own_key
    return optimizer


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
