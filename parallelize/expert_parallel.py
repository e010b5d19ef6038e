"""Expert parallel: each rank of the ``ep`` mesh holds 1/ep of every MoE layer's experts, and tokens travel to them.

The model stays single-device (models/moe.py): its MoE layer routes tokens, sorts them by expert and calls
``experts(routed_input, num_tokens_per_expert)``. ``ExpertParallel`` (a torch ``ParallelStyle``, applied to that
``experts`` module from outside, as torchtitan does) shards the stacked expert weights by expert (``Shard(0)``)
and wraps the call: dispatch (one small all-to-all of counts, then an uneven ``all_to_all_single`` of the rows,
reordered by local expert), the local experts, and the reverse combine. Both exchanges are autograd-aware; the
split sizes are read on the host once per layer and forward, inherent to uneven all-to-alls. The result equals
one process's. Expert weights are FSDP-sharded over ``efsdp`` and scale their gradient by 1/ep, so it is the mean
over all dp_shard × cp ranks (FSDP's own divide factor would need a PREMUL_SUM reduce-scatter, which gloo lacks).

The mesh, gradients and what composes: docs/parallelism.md, "Expert parallel".
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from dtrain.models.moe import GroupedExperts, run_experts
from dtrain.parallelize.moe_hooks import moe_layers


class ExpertParallel(ParallelStyle):
    """Shard a ``GroupedExperts`` module's experts over a 1-D ``ep`` mesh and route its tokens there and back."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, GroupedExperts):
            raise TypeError(f"ExpertParallel applies to GroupedExperts, not {type(module).__name__}")
        experts = module.w1.shape[0]
        if experts % device_mesh.size():
            raise ValueError(f"{experts} experts cannot be split over {device_mesh.size()} expert-parallel ranks")
        distribute_module(module, device_mesh, self._shard_experts, self._dispatch, self._combine)
        # The experts compute on this rank's shard of the weights (plain tensors): to_local keeps the gradient
        # path to the sharded parameters. Their gradients sum the tokens of all ep ranks, which the data-parallel
        # mean (over the remaining efsdp ranks only) would not divide by: 1/ep here completes it.
        ep = device_mesh.size()
        module.forward = lambda x, counts: run_experts(
            x, counts, *(ScaleGradient.apply(w.to_local(), 1.0 / ep) for w in module.weights())
        )
        return module

    @staticmethod
    def _shard_experts(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, device_mesh, [Shard(0)])
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    @staticmethod
    def _dispatch(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        routed_input, num_tokens_per_expert = inputs
        ep = device_mesh.size()
        group = device_mesh.get_group()
        # counts_by_source[s, j]: rows rank s sends to this rank's local expert j.
        counts_by_source = all_to_all_single(num_tokens_per_expert, None, None, group).view(ep, -1)
        send = num_tokens_per_expert.view(ep, -1).sum(dim=1).tolist()
        receive = counts_by_source.sum(dim=1).tolist()
        received = all_to_all_single_autograd(routed_input, receive, send, group)
        order = _by_expert_order(counts_by_source, sum(receive))
        module._ep_exchange = (send, receive, order)
        return received.index_select(0, order), counts_by_source.sum(dim=0)

    @staticmethod
    def _combine(module: nn.Module, routed_output: torch.Tensor, device_mesh: DeviceMesh) -> torch.Tensor:
        send, receive, order = module._ep_exchange
        del module._ep_exchange
        by_source = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
        back = routed_output.index_select(0, by_source)
        return all_to_all_single_autograd(back, send, receive, device_mesh.get_group())


class ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _by_expert_order(counts_by_source: torch.Tensor, total: int) -> torch.Tensor:
    """The row order that turns the received rows, grouped by (source rank, local expert), into rows grouped by
    (local expert, source rank): ``received[order]``. Computed on the device from the counts alone."""
    flat = counts_by_source.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view_as(counts_by_source)
    # Walk the blocks expert-major: block (j, s) starts at starts[s, j] and holds counts_by_source[s, j] rows.
    block_counts, block_starts = counts_by_source.t().flatten(), starts.t().flatten()
    first_row = torch.repeat_interleave(block_starts, block_counts, output_size=total)
    block_ends = torch.cumsum(block_counts, 0)
    block_offset = torch.repeat_interleave(block_ends - block_counts, block_counts, output_size=total)
    return first_row + torch.arange(total, device=flat.device) - block_offset


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Expert parallel for every MoE layer of `model` (a whole model or a pipeline stage), in place."""
    for moe in moe_layers([model]):
        ExpertParallel()._apply(moe.experts, ep_mesh)


def shard_experts(model: nn.Module, **fsdp_settings) -> None:
    """FSDP (``fully_shard(**fsdp_settings)``, whose mesh is efsdp) for the expert weights of every MoE layer,
    before the blocks' own FSDP, which then leaves them alone."""
    for moe in moe_layers([model]):
        fully_shard(moe.experts, **fsdp_settings)
