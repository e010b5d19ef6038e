"""Tensor (and sequence) parallel building blocks shared by every model plan: styles, plan printing, loss
parallel and async TP.

A plan is data: a dict from module paths (``*`` matches any child name, as in ``layers.*.attention.wq``) to a
torch ``ParallelStyle``. ``apply_tp`` hands it to ``parallelize_module``; ``format_tp_plan`` prints it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import warnings
from typing import Callable, ContextManager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, loss_parallel, parallelize_module

from dtrain.parallelize.errors import ParallelismError
from dtrain.parallelize.parallel_dims import ParallelDims

TPPlan = dict[str, ParallelStyle]


class SyncOutputRowwiseParallel(RowwiseParallel):
    """RowwiseParallel whose output collective completes before the output is handed on.

    torch's RowwiseParallel redistributes its output with ``async_op=True``, so ``to_local()`` yields an
    AsyncCollectiveTensor. When that tensor is the input of a ``torch.compile``d block, the block's backward
    hands the redistribute's backward a plain Tensor, which fails with ``'Tensor' object has no attribute
    '_local_tensor'`` (torch 2.13 on CPU, with inductor and with aot_eager, so it is dynamo/AOTAutograd's
    handling of that wrapper). A synchronous redistribute returns an ordinary tensor and trains exactly. Nothing
    is lost: the next op (the first block's norm) needs the result at once anyway. Used for the token embedding,
    whose output feeds the (compiled) first block.
    """

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


class ReplicateParallel(ParallelStyle):
    """Keep a module whole on every TP rank: parameters become Replicate DTensors, input and output stay local.

    Used for the norms when sequence parallel is off. The math is unchanged, but every parameter of a TP model
    then lives on the TP mesh, which gradient clipping (one norm over DTensors of one mesh) and fully_shard (one
    all-gather per block) rely on. Parameters are wrapped with ``from_local``: no communication, and the values
    are set afterwards by the initialisation that follows parallelization.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, lambda _, owner, mesh: replicate_params(owner, mesh), self._to_dtensor, self._to_local
        )

    @staticmethod
    def _to_dtensor(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    @staticmethod
    def _to_local(module: nn.Module, output: torch.Tensor, device_mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local() if isinstance(output, DTensor) else output

    def __repr__(self) -> str:
        return "ReplicateParallel()"


def replicate_params(module: nn.Module, device_mesh: DeviceMesh) -> None:
    """`module`'s own parameters that are not DTensors yet become Replicate DTensors on `device_mesh`. With
    ``from_local``: no communication; the values are set by the initialisation that follows parallelization."""
    for param_name, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            replicated = DTensor.from_local(param.data, device_mesh, [Replicate()], run_check=False)
            module.register_parameter(param_name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def modules_at(model: nn.Module, path: str) -> list[nn.Module]:
    """The modules a plan path names (``*`` and other fnmatch patterns per dotted atom, as parallelize_module
    matches them)."""
    modules = [model]
    for atom in path.split("."):
        modules = [child for m in modules for name, child in m.named_children() if fnmatch.fnmatch(name, atom)]
    return modules


def resolve_plan(plan: TPPlan, model: nn.Module) -> TPPlan:
    """`plan` with only the modules `model` (or this pipeline stage) has. A block path (``layers.*.x``) stays a
    wildcard where every block has the module and is spelled out per block where only some do
    (``layers.0.feed_forward`` when the others are MoE blocks): torch's parallelize_module would skip the others
    with a warning that prints each whole block. A stage without blocks, or without the embedding or head, drops
    those entries."""
    resolved: TPPlan = {}
    for path, style in plan.items():
        head, _, rest = path.partition(".*.")
        if not rest:
            if modules_at(model, path):
                resolved[path] = style
            continue
        blocks = dict(getattr(model, head).named_children())
        holders = [name for name, block in blocks.items() if modules_at(block, rest)]
        if holders and len(holders) == len(blocks):
            resolved[path] = style
        else:
            resolved.update({f"{head}.{name}.{rest}": style for name in holders})
    return resolved


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan) -> None:
    """Apply a TP plan in place (parameters become DTensors on ``tp_mesh``); frozen parameters stay frozen."""
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, tp_mesh, plan)
    # torch's SequenceParallel re-registers a norm's parameters as trainable (torch 2.13), which would unfreeze a
    # LoRA run's base norms.
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def _describe_placements(placements: tuple[Placement | None, ...] | Placement | None) -> str:
    if placements is None or isinstance(placements, Placement):
        return str(placements)
    if len(placements) == 1:
        return str(placements[0])
    return "(" + ", ".join(str(p) for p in placements) + ")"


def describe_style(style: ParallelStyle) -> str:
    """One line: the style's name and the layouts it declares (torch's own reprs differ between versions)."""
    fields = []
    for attr, label in (
        ("input_layouts", "in"),
        ("desired_input_layouts", "desired_in"),
        ("output_layouts", "out"),
        ("sequence_sharding", "sequence"),
        ("use_local_output", "local_output"),
    ):
        if hasattr(style, attr):
            value = getattr(style, attr)
            fields.append(f"{label}={value if isinstance(value, bool) else _describe_placements(value)}")
    return f"{type(style).__name__}({', '.join(fields)})"


def format_tp_plan(plan: TPPlan) -> str:
    """The plan as aligned ``module path  style`` lines, for logs and ``--help``-style inspection."""
    width = max((len(path) for path in plan), default=0)
    return "\n".join(f"{path.ljust(width)}  {describe_style(style)}" for path, style in plan.items())


def loss_parallel_context(dims: ParallelDims) -> ContextManager:
    """The context the forward, loss and backward must run in: vocab-parallel cross-entropy when enabled.

    Under loss parallel the logits stay sharded over the vocabulary (a DTensor) and ``F.cross_entropy`` runs
    on the shards, so the full ``[batch, seq, vocab]`` logits never exist on one rank.
    """
    return loss_parallel() if dims.loss_parallel_enabled else contextlib.nullcontext()


def local_loss(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap a loss function so that its result is a plain tensor also under loss parallel.

    With vocab-sharded logits the cross-entropy comes back as a DTensor replicated over the TP ranks; the step
    then mixes it with plain tensors (token counts, accumulators), which DTensor refuses. ``full_tensor`` of a
    replicated value costs no communication and is differentiable, so backward still reaches every shard.
    """

    @functools.wraps(loss_fn)
    def plain_loss(*args, **kwargs) -> torch.Tensor:
        loss = loss_fn(*args, **kwargs)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    return plain_loss


def check_async_tp(enabled: bool, *, tp: int, device_type: str, compile_model: bool) -> None:
    """Refuse async TP where it cannot work (it needs TP, CUDA, NCCL and a compiled model) in one line."""
    if not enabled:
        return
    key = "parallelism.enable_async_tensor_parallel"
    if tp < 2:
        raise ParallelismError(f"{key} needs parallelism.tensor_parallel_degree > 1 (got {tp})")
    if device_type != "cuda" or not torch.distributed.is_nccl_available():
        raise ParallelismError(
            f"{key} needs CUDA GPUs with NCCL (symmetric memory); this run uses {device_type} "
            f"(valid here: false)"
        )
    if not compile_model:
        raise ParallelismError(f"{key} works through torch.compile; set compile.enable (with 'model' in compile.components)")


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Let inductor fuse TP collectives with the matmuls next to them (micro-pipelining over symmetric memory)."""
    from torch._inductor import config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    # Older torch needs the group registered; newer torch sets symmetric memory up on demand and only warns here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
