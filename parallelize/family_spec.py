"""A model family as one value: its single-device half (``ModelFamily``) and how it is parallelized.

Shared trainer and parallelize code reads a family only through this value (and the decoder protocol of its
models); adding a family means a model folder with its ``ModelFamily`` and HF adapter, a plan file in
``parallelize/`` that defines its ``FamilySpec``, and one registration line in ``parallelize/families.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from dtrain.models.family import ModelFamily
from dtrain.parallelize.mesh import ParallelMesh
from dtrain.parallelize.options import ParallelizeOptions
from dtrain.parallelize.parallel_dims import ParallelDims
from dtrain.parallelize.tensor_parallel import TPPlan


@dataclass(frozen=True)
class FamilySpec:
    """Everything the trainer needs of a family.

    - ``model``: builds, sizes, counts and converts its models (``dtrain.models.family``);
    - ``parallelize(model, mesh, dims, options)``: applies TP, AC, compile and data parallel in place, to a whole
      model or a pipeline stage (the pipeline split itself is shared, through the decoder protocol);
    - ``tp_plan(sequence_parallel=, loss_parallel=)``: the tensor-parallel plan, as data, for the log;
    - ``tp_sizes(args)``: every size tensor parallel must divide, by the config key (or description) to name.
    """

    model: ModelFamily
    parallelize: Callable[[nn.Module, ParallelMesh | None, ParallelDims, ParallelizeOptions], nn.Module]
    tp_plan: Callable[..., TPPlan]
    tp_sizes: Callable[[Any], dict[str, int]]

    @property
    def name(self) -> str:
        return self.model.name

    def check_shapes(self, dims: ParallelDims, args: Any, seq_len: int) -> None:
        """A one-line ParallelismError when the degrees cannot split this model's shapes."""
        dims.check_tp_divides(self.tp_sizes(args), seq_len)
