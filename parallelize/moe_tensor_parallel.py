"""Tensor parallel for MoE layers (models/moe.py), with the routed experts whole on every TP rank (no expert tensor
parallel), as torchtitan lays them out when ``expert_tensor_parallel_degree`` is 1.

The shared experts split like the dense feed-forward (w1/w3 by output features, w2 by input features). The
router and the routed experts are not split: every TP rank routes the same tokens (under sequence parallel the
layer gathers the sequence at its entry and hands back this rank's slice) and computes what one process does.
Their weights become Replicate DTensors on the tp mesh (the optimizer's foreach step cannot mix DTensors with
plain tensors, and FSDP shards the block as one unit) but are computed through their local tensors, since
sorting, grouped GEMMs and all-to-alls are not DTensor ops; a gradient computed from the same tokens on every
rank is whole and equal everywhere, which is what a Replicate gradient is. With expert parallel the routed
experts belong to the ``ep`` mesh instead (expert_parallel.py). See docs/parallelism.md, "Expert parallel".
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInputOutput, RowwiseParallel

from dtrain.models.moe import GroupedExperts, TokenChoiceTopKRouter, run_experts
from dtrain.parallelize.tensor_parallel import TPPlan, replicate_params

ROUTED_EXPERTS = "moe.experts"


class LocalReplicate(ParallelStyle):
    """Keep a module whole on every TP rank, its parameters Replicate DTensors, and run
    ``local_forward(module, *inputs)``, which computes on their local tensors (``local``)."""

    def __init__(self, local_forward: Callable[..., torch.Tensor | tuple]) -> None:
        super().__init__()
        self.local_forward = local_forward

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for owner in module.modules():
            replicate_params(owner, device_mesh)
        module.forward = functools.partial(self.local_forward, module)
        return module

    def __repr__(self) -> str:
        return f"LocalReplicate({self.local_forward.__name__})"


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor parameter (differentiable: its gradient returns with the same placements)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def route_on_local_weight(router: TokenChoiceTopKRouter, x: torch.Tensor, expert_bias: torch.Tensor | None):
    return router.route(x, local(router.gate.weight), expert_bias)


def experts_on_local_weights(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return run_experts(x, counts, *(local(w) for w in experts.weights()))


def moe_tp_plan(*, sequence_parallel: bool) -> TPPlan:
    """Paths below a MoE block (``moe...``) -> ParallelStyle, as the module doc lays them out."""
    seq = Shard(1)
    whole_sequence = {
        "moe": PrepareModuleInputOutput(
            input_layouts=(seq,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(seq,),
        )
    }
    return {
        **(whole_sequence if sequence_parallel else {}),
        "moe.router": LocalReplicate(route_on_local_weight),
        ROUTED_EXPERTS: LocalReplicate(experts_on_local_weights),
        "moe.shared_experts.w1": ColwiseParallel(),
        "moe.shared_experts.w3": ColwiseParallel(),
        "moe.shared_experts.w2": RowwiseParallel(output_layouts=Replicate()),
    }


def without_routed_experts(plan: TPPlan) -> TPPlan:
    """`plan` less the routed experts, for expert parallel, which shards them over ``ep`` instead."""
    return {path: style for path, style in plan.items() if not path.endswith(ROUTED_EXPERTS)}
