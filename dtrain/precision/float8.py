"""float8 training through torchao: which linears convert, the run's torchao config, and the FSDP scale hook.

The conversion runs on the model built on the meta device, before parallelize (``model_builder``), so that
parallelize sees torchao's ``Float8Linear`` modules: FSDP2 can all-gather their weights in float8, and tensor
parallel gives them torchao's float8 styles (parallelize/float8_tp.py). Parameter names do not change, so
checkpoints move freely between float8 and high-precision runs.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from dtrain.config.converters import FLOAT8_NAMES
from dtrain.config.schema_opt_in import QuantizeLinearFloat8
from dtrain.step.torchao_import import quiet_torchao_import

logger = logging.getLogger("dtrain")

FLOAT8_MATMUL_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores
FLOAT8_DIM_MULTIPLE = 16  # torch._scaled_mm needs both dimensions of a float8 operand to be multiples of 16


def has_float8_matmul(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FLOAT8_MATMUL_CAPABILITY


def linear_filter(
    filter_fqns: tuple[str, ...], dim_multiple: int = FLOAT8_DIM_MULTIPLE
) -> Callable[[nn.Module, str], bool]:
    """torchao's module filter: convert a linear unless its name contains one of `filter_fqns` or a dimension of
    its weight is not a multiple of `dim_multiple`."""

    def convert(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        fits = all(size % dim_multiple == 0 for size in module.weight.shape)
        return fits and not any(name in fqn for name in filter_fqns)

    return convert


@dataclass(frozen=True)
class Float8Training:
    """The torchao config of this run, the linears to leave alone, and whether FSDP scales are precomputed."""

    config: Any  # torchao.float8.Float8LinearConfig
    filter_fqns: tuple[str, ...]
    precompute_scales: bool

    def convert(self, model: nn.Module) -> None:
        """Swap the model's eligible nn.Linear modules for torchao's Float8Linear, in place."""
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, config=self.config, module_filter_fn=linear_filter(self.filter_fqns))

    @property
    def optimizer_step_hook(self) -> Callable[[list[nn.Module]], None] | None:
        return self._precompute_scales if self.precompute_scales else None

    @staticmethod
    def _precompute_scales(model_parts: list[nn.Module]) -> None:
        # One all-reduce of every float8 weight's amax after the update, instead of one per weight in the next
        # forward's all-gathers.
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)


def build_float8_training(
    converters: list[str], f8: QuantizeLinearFloat8, tensor_parallel_degree: int, fsdp_enabled: bool,
    device: torch.device,
) -> Float8Training | None:
    """The run's float8 training, or None when `converters` (`model.converters`) does not ask for it (config
    already validated); `f8` is `[quantize.linear.float8]`.

    Without float8 matmul hardware the matmuls are emulated in high precision (the casts and scales are real), so
    that a float8 config trains, and can be tested, anywhere.
    """
    if not any(name in FLOAT8_NAMES for name in converters):
        return None
    with quiet_torchao_import():
        from torchao.float8 import Float8LinearConfig

    emulate = f8.emulate or not has_float8_matmul(device)
    if emulate and not f8.emulate:
        logger.info(
            "float8: this %s has no float8 matmuls (they need CUDA compute capability >= 8.9): emulating them "
            "(quantize.linear.float8.emulate)", "GPU" if device.type == "cuda" else device.type.upper(),
        )
    # torchtitan's choice: the float8 all-gather only means something when FSDP gathers the weights.
    all_gather = f8.enable_fsdp_float8_all_gather and fsdp_enabled
    if f8.enable_fsdp_float8_all_gather and not fsdp_enabled:
        logger.warning(
            "quantize.linear.float8.enable_fsdp_float8_all_gather (and the scale precompute) has no effect: this "
            "layout has no FSDP to gather weights"
        )
    if f8.recipe_name == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather, emulate=emulate)
    else:
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(f8.recipe_name), emulate=emulate)
    logger.info(
        "float8 training: recipe %s%s%s, high precision for linears named %s or with a dimension not a multiple of 16",
        f8.recipe_name, ", emulated" if emulate else "", ", float8 FSDP all-gather" if all_gather else "",
        ", ".join(f8.filter_fqns) or "(none)",
    )
    if tensor_parallel_degree > 1 and f8.recipe_name == "tensorwise":
        logger.info(
            "float8 tensor parallel: torchao's float8 styles replace the plan's styles of float8 linears (casts "
            "before the collectives; float8 on the wire with NCCL, high precision with gloo)"
        )
    return Float8Training(
        config, tuple(f8.filter_fqns), precompute_scales=all_gather and f8.precompute_float8_dynamic_scale_for_fsdp
    )
