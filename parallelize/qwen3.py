"""Parallelizing the Qwen3 family: the shared decoder's plan and order (parallelize/decoder_plan.py) plus its QK-norm.

QK-norm weights scale each head's features of the queries and keys. Under TP the projections hand over this
rank's heads only, so the norm runs on a tensor sharded over its head dimension (dim 2 of ``[b, s, heads,
head_dim]``): ``SequenceParallel(sequence_dim=2)`` keeps the weight replicated and makes its gradient a partial
sum over the TP ranks, whatever sequence parallel does elsewhere.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from dtrain.models.qwen3 import QWEN3
from dtrain.parallelize.decoder_plan import (
    decoder_tp_plan,
    decoder_tp_sizes,
    grouped_query_projections,
    parallelize_decoder,
)
from dtrain.parallelize.family_spec import FamilySpec
from dtrain.parallelize.mesh import ParallelMesh
from dtrain.parallelize.moe_hooks import MOE_STEP_HOOKS
from dtrain.parallelize.options import ParallelizeOptions
from dtrain.parallelize.parallel_dims import ParallelDims
from dtrain.parallelize.tensor_parallel import TPPlan


def qwen3_tp_plan(*, sequence_parallel: bool = True, loss_parallel: bool = True) -> TPPlan:
    """Module path -> ParallelStyle for a Qwen3 model: the shared decoder's around grouped-query attention (as
    Llama 3's), and the QK-norms on this rank's heads."""
    heads_sharded = SequenceParallel(sequence_dim=2, use_local_output=True)
    projections = grouped_query_projections()
    return {
        **decoder_tp_plan(projections, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel),
        "layers.*.attention.q_norm": heads_sharded,
        "layers.*.attention.k_norm": heads_sharded,
    }


def parallelize_qwen3(
    model: nn.Module, mesh: ParallelMesh | None, dims: ParallelDims, options: ParallelizeOptions
) -> nn.Module:
    """Apply TP, activation checkpointing, compile and data parallel to a Qwen3 model, in place."""
    return parallelize_decoder(model, mesh, dims, options, qwen3_tp_plan)


QWEN3_SPEC = FamilySpec(
    model=QWEN3,
    parallelize=parallelize_qwen3,
    tp_plan=qwen3_tp_plan,
    tp_sizes=decoder_tp_sizes,
    # Qwen3-MoE flavors: their layers' load-balancing losses, load statistics, and loss-free bias when configured.
    **MOE_STEP_HOOKS,
)
