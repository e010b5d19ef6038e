"""Tensor parallel for float8 linears: torchao's float8 TP styles in place of torch's, where they apply.

torchao's ``Float8ColwiseParallel``, ``Float8RowwiseParallel`` and ``PrepareFloat8ModuleInput`` shard exactly as
torch's styles do; they only cast activations (forward) and gradients (backward) to float8 *before* the
sequence-parallel collectives instead of inside the matmul after them, so that those collectives move half the
bytes of bf16. The casts use tensorwise scales computed over the whole DTensor (one max all-reduce), so the float8
values are the same either way: only the bytes on the wire differ. torchtitan uses them for the tensorwise recipe
only; rowwise recipes keep torch's styles.

The swap is generic (no module names): a style is replaced where every module it targets is a tensorwise
``Float8Linear``, and a ``PrepareModuleInput`` where every linear inside its module is one (its input is cast to
float8 once, then gathered, for all of them).
"""

from __future__ import annotations

import sys

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from dtrain.parallelize.tensor_parallel import TPPlan, modules_at


def is_tensorwise_float8(module: nn.Module) -> bool:
    """A torchao Float8Linear whose casts all scale per tensor, dynamically: what the float8 TP styles support."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_linear import Float8Linear

    if not isinstance(module, Float8Linear):
        return False
    casts = (module.config.cast_config_input, module.config.cast_config_weight, module.config.cast_config_grad_output)
    return all(
        c.scaling_type is ScalingType.DYNAMIC and c.scaling_granularity is ScalingGranularity.TENSORWISE for c in casts
    )


def carries_float8(tp_mesh: DeviceMesh) -> bool:
    """Whether the TP group's collectives can move float8 tensors. NCCL can; gloo cannot (it fails with "Invalid
    scalar type", torch 2.13)."""
    return tp_mesh.device_type == "cuda" and "nccl" in str(dist.get_backend(tp_mesh.get_group()))


def _gathers(placements) -> bool:
    """Whether redistributing between placements and Replicate moves data (a gather or its reduce-scatter
    gradient), as opposed to a no-op or an all-reduce."""
    return any(p is not None and not isinstance(p, Replicate) for p in placements)


def float8_style(style: ParallelStyle, modules: list[nn.Module], float8_collectives: bool) -> ParallelStyle:
    """`style`, or its torchao float8 equivalent when every one of `modules` is a tensorwise float8 linear (a
    PrepareModuleInput: when every linear inside them is) and the collectives it would add can carry float8.

    Without float8 collectives (gloo), a style whose forward or backward gathers a float8 tensor over the sequence
    stays torch's: the cast then happens inside the float8 linear after a high-precision gather, with the same
    scale and so the same float8 values (module doc).
    """
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    if not modules:
        return style
    if type(style) in (ColwiseParallel, RowwiseParallel) and all(is_tensorwise_float8(m) for m in modules):
        # Colwise gathers its input, rowwise's backward gathers the gradient of its sharded output.
        layouts = style.input_layouts if type(style) is ColwiseParallel else style.output_layouts
        if _gathers(layouts) and not float8_collectives:
            return style
        float8_cls = Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
        return float8_cls(
            input_layouts=style.input_layouts[0],
            output_layouts=style.output_layouts[0],
            use_local_output=style.use_local_output,
        )
    if type(style) is PrepareModuleInput and float8_collectives:
        linears = [m for module in modules for m in module.modules() if isinstance(m, nn.Linear)]
        if linears and all(is_tensorwise_float8(m) for m in linears) and not style.input_kwarg_layouts:
            return PrepareFloat8ModuleInput(
                input_layouts=style.input_layouts,
                desired_input_layouts=style.desired_input_layouts,
                use_local_output=style.use_local_output,
            )
    return style


def float8_tp_plan(plan: TPPlan, model: nn.Module, tp_mesh: DeviceMesh) -> TPPlan:
    """`plan` with torchao's float8 styles wherever they apply to `model` (module doc)."""
    if "torchao.float8.float8_linear" not in sys.modules:
        return plan  # torchao was never loaded, so no module of this model is a float8 linear
    float8_collectives = carries_float8(tp_mesh)
    return {path: float8_style(style, modules_at(model, path), float8_collectives) for path, style in plan.items()}
