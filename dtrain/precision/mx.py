"""MXFP8 training through torchao: the run's MX config and which linears convert.

MX formats scale every block of 32 consecutive elements by its own power of two (e8m0), which keeps float8's
range per block rather than per tensor or row. torchao's ``MXFP8TrainingOpConfig`` swaps each converted linear's
weight for a wrapper tensor whose matmuls quantize both operands to MXFP8 on the fly; the parameter stays the
same high-precision master weight, so names, dtypes and checkpoints do not change. MX matmuls need a
Blackwell-class GPU; the ``mxfp8_emulated_rceil`` recipe runs the same casts with high-precision matmuls anywhere
(what the CPU tests use). Where MX cannot run, the config check refuses it in one line (config/converters.py;
what depends on the torch version, run/prepare.py).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from dtrain.config.converters import MX_NAMES
from dtrain.config.schema_opt_in import QuantizeLinearMX
from dtrain.parallelize.torch_compat import MXFP8_TRAINING_SUPPORTED
from dtrain.precision.float8 import linear_filter
from dtrain.step.torchao_import import quiet_torchao_import

logger = logging.getLogger("dtrain")

MX_BLOCK_SIZE = 32  # elements per e8m0 scale: a converted linear's dimensions must be multiples of it


@dataclass(frozen=True)
class MXTraining:
    """The torchao MX config of this run and the linears to leave alone."""

    config: Any  # torchao.prototype.moe_training.config.MXFP8TrainingOpConfig
    filter_fqns: tuple[str, ...]

    def convert(self, model: nn.Module) -> None:
        """Give the model's eligible nn.Linear weights torchao's MXFP8 training wrapper, in place."""
        from torchao.quantization import quantize_

        quantize_(model, config=self.config, filter_fn=linear_filter(self.filter_fqns, MX_BLOCK_SIZE))

    @property
    def optimizer_step_hook(self) -> Callable[[list[nn.Module]], None] | None:
        return None  # MX scales are computed in each matmul: nothing to precompute after a step


def allow_mx_tensors_in_checkpoints() -> None:
    """Let checkpoints hold MX-wrapped tensors, wherever torchao's MX training can run (else there are none). DCP
    pickles a converted weight as torchao's wrapper class with its config, which torch.load(weights_only=True), the
    only way dtrain reads tensors, refuses unless allowlisted (as torchao.optim allowlists its low-bit optimizer
    states). Called before every checkpoint read, so that any run (MX or not) and any conversion reads them."""
    if not MXFP8_TRAINING_SUPPORTED or importlib.util.find_spec("torchao") is None:
        return
    import torch

    with quiet_torchao_import():  # every checkpoint read passes here: a resume must not print torchao's noise
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
        from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common import KernelPreference

    # The wrapper pickles its config, and the config its two enums.
    torch.serialization.add_safe_globals(
        [MXFP8TrainingWeightWrapperTensor, MXFP8TrainingOpConfig, ScaleCalculationMode, KernelPreference]
    )


def build_mx_training(converters: list[str], mx: QuantizeLinearMX) -> MXTraining | None:
    """The run's MX training, or None when `converters` (`model.converters`) does not ask for it (config already
    validated); `mx` is `[quantize.linear.mx]`."""
    if not any(name in MX_NAMES for name in converters):
        return None
    with quiet_torchao_import():
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe

    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(mx.recipe_name))
    logger.info(
        "MX training: recipe %s, high precision for linears named %s or with a dimension not a multiple of %d",
        mx.recipe_name, ", ".join(mx.filter_fqns) or "(none)", MX_BLOCK_SIZE,
    )
    return MXTraining(config, tuple(mx.filter_fqns))
