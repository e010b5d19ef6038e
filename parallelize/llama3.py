"""Parallelizing the Llama 3 family: the shared decoder's plan around grouped-query attention, applied in the
shared order (parallelize/decoder_plan.py)."""

from __future__ import annotations

from torch import nn

from dtrain.models.llama3 import LLAMA3
from dtrain.parallelize.decoder_plan import (
    decoder_tp_plan,
    decoder_tp_sizes,
    grouped_query_projections,
    parallelize_decoder,
)
from dtrain.parallelize.family_spec import FamilySpec
from dtrain.parallelize.mesh import ParallelMesh
from dtrain.parallelize.options import ParallelizeOptions
from dtrain.parallelize.parallel_dims import ParallelDims
from dtrain.parallelize.tensor_parallel import TPPlan


def llama3_tp_plan(*, sequence_parallel: bool = True, loss_parallel: bool = True) -> TPPlan:
    """Module path -> ParallelStyle for a Llama 3 model (Megatron layout; ``decoder_tp_plan``): wq/wk/wv split by
    output features, whole query and kv heads per rank."""
    projections = grouped_query_projections()
    return decoder_tp_plan(projections, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def parallelize_llama(
    model: nn.Module, mesh: ParallelMesh | None, dims: ParallelDims, options: ParallelizeOptions
) -> nn.Module:
    """Apply TP, activation checkpointing, compile and data parallel to a Llama 3 model, in place (the order of
    parallelize/decoder_plan.py).

    Typically called on a model built on the meta device; afterwards ``model.to_empty(device=...)`` and
    ``init_weights_like_single_device`` give it its values. `mesh` may be None only for a single process.
    """
    return parallelize_decoder(model, mesh, dims, options, llama3_tp_plan)


LLAMA3_SPEC = FamilySpec(model=LLAMA3, parallelize=parallelize_llama, tp_plan=llama3_tp_plan, tp_sizes=decoder_tp_sizes)
