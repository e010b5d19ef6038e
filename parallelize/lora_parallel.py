"""LoRA adapters under parallelism: tensor-parallel styles that place them with their base linear, and the copy of
whole (single-process) tensors into any layout's parameters.

A LoRA linear (dtrain/precision/lora.py) is known here by its shape alone (``is_lora_linear``: an ``nn.Linear``
with child linears ``lora_a`` and ``lora_b``), as parallelize may not import the trainer. torch's
Colwise/RowwiseParallel would shard every parameter below it alike; instead the adapters follow their base's
placement, so base and update produce the same layout and add without a collective of their own: a
column-parallel base gets a replicated ``lora_a`` and a ``Shard(0)`` ``lora_b``; a row-parallel one a
``Shard(1)`` ``lora_a`` and a replicated ``lora_b``, the two partial sums reduced once by the style's output
redistribution. ``ReplicateParallel`` replicates the adapters with the rest; any other style on a LoRA linear is
refused in one line. See docs/fine-tuning.md, "LoRA" ("Layouts").
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from dtrain.parallelize.errors import ParallelismError
from dtrain.parallelize.init import _local_part, model_fqn
from dtrain.parallelize.moe_tensor_parallel import LocalReplicate
from dtrain.parallelize.tensor_parallel import ReplicateParallel, TPPlan


def is_lora_linear(module: nn.Module) -> bool:
    """A linear with LoRA adapters: an ``nn.Linear`` with ``lora_a`` and ``lora_b`` linears (module doc)."""
    return (
        isinstance(module, nn.Linear)
        and isinstance(getattr(module, "lora_a", None), nn.Linear)
        and isinstance(getattr(module, "lora_b", None), nn.Linear)
    )


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement, src_data_rank) -> None:
    param = getattr(module, name)
    if param is None:
        return
    dist_param = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
    module.register_parameter(name, nn.Parameter(dist_param, requires_grad=param.requires_grad))


class LoRAColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a LoRA linear: base Shard(0), ``lora_a`` Replicate, ``lora_b`` Shard(0)."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if not is_lora_linear(module):
            return  # its adapters: placed below, with their base linear
        _distribute(module, "weight", device_mesh, Shard(0), self.src_data_rank)
        _distribute(module, "bias", device_mesh, Shard(0), self.src_data_rank)
        _distribute(module.lora_a, "weight", device_mesh, Replicate(), self.src_data_rank)
        _distribute(module.lora_b, "weight", device_mesh, Shard(0), self.src_data_rank)


class LoRARowwiseParallel(RowwiseParallel):
    """RowwiseParallel for a LoRA linear: base Shard(1) (bias Replicate), ``lora_a`` Shard(1), ``lora_b``
    Replicate."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if not is_lora_linear(module):
            return
        _distribute(module, "weight", device_mesh, Shard(1), self.src_data_rank)
        _distribute(module, "bias", device_mesh, Replicate(), self.src_data_rank)
        _distribute(module.lora_a, "weight", device_mesh, Shard(1), self.src_data_rank)
        _distribute(module.lora_b, "weight", device_mesh, Replicate(), self.src_data_rank)


def lora_style(style: ParallelStyle, path: str) -> ParallelStyle:
    """The style for LoRA linears that `style` would give plain linears (`path` names them in the error)."""
    if type(style) in (ColwiseParallel, RowwiseParallel):
        lora_cls = LoRAColwiseParallel if type(style) is ColwiseParallel else LoRARowwiseParallel
        return lora_cls(
            input_layouts=style.input_layouts[0],
            output_layouts=style.output_layouts[0],
            use_local_output=style.use_local_output,
        )
    if isinstance(style, ReplicateParallel):
        return style
    raise ParallelismError(
        f"LoRA on {path} cannot be expressed under tensor parallel: its plan gives it {type(style).__name__} "
        "(LoRA follows column-parallel, row-parallel or replicated linears); leave it out of lora.target_modules "
        "or set parallelism.tensor_parallel_degree = 1"
    )


def _paths(model: nn.Module, path: str) -> list[str]:
    """The module paths a plan path names in `model` (fnmatch per dotted atom, as parallelize_module matches)."""
    paths = [""]
    for atom in path.split("."):
        paths = [
            f"{p}.{name}" if p else name
            for p in paths
            for name, _ in (model.get_submodule(p) if p else model).named_children()
            if fnmatch.fnmatch(name, atom)
        ]
    return paths


def lora_tp_plan(plan: TPPlan, model: nn.Module) -> TPPlan:
    """`plan` with the LoRA styles wherever it targets LoRA linears; a path that names LoRA linears and plain ones
    (adapters on some blocks only) is spelled out per module."""
    resolved: TPPlan = {}
    for path, style in plan.items():
        paths = _paths(model, path)
        wrapped = [p for p in paths if is_lora_linear(model.get_submodule(p))]
        if isinstance(style, LocalReplicate):
            _refuse_adapters_inside(model, paths, style)
        if not wrapped:
            resolved[path] = style
        elif len(wrapped) == len(paths):
            resolved[path] = lora_style(style, path)
        else:
            resolved.update({p: lora_style(style, p) if p in wrapped else style for p in paths})
    return resolved


def _refuse_adapters_inside(model: nn.Module, paths: list[str], style: ParallelStyle) -> None:
    """A LocalReplicate module (the MoE router) computes on its weights' local tensors, which would skip the
    adapters of a LoRA linear inside it."""
    for path in paths:
        modules = model.get_submodule(path).named_modules()
        inside = [f"{path}.{name}".rstrip(".") for name, m in modules if is_lora_linear(m)]
        if inside:
            raise ParallelismError(
                f"LoRA on {inside[0]} cannot be expressed under tensor parallel: {style} computes on its local "
                "weights; leave it out of lora.target_modules or set parallelism.tensor_parallel_degree = 1"
            )


@torch.no_grad()
def copy_full_params(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Give the parameters of `model` named in `full` (model FQNs -> whole tensors) their values, each rank its
    own part in the parameter's layout (sharded or not; no communication)."""
    for name, param in model.named_parameters():
        value = full.get(model_fqn(name))
        if value is None:
            continue
        local = param.to_local() if isinstance(param, DTensor) else param
        local.copy_(_local_part(value, param))
