"""A model family as one value: its single-device half (``ModelFamily``) and how it is parallelized.

Shared trainer and parallelize code reads a family only through this value (and the decoder protocol of its
models); adding a family means a model folder with its ``ModelFamily`` and HF adapter, a plan file in
``parallelize/`` that defines its ``FamilySpec``, and one registration line in ``parallelize/families.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from dtrain.models.decoder import DecoderArgs
from dtrain.models.family import ModelFamily
from dtrain.parallelize.errors import ParallelismError
from dtrain.parallelize.mesh import ParallelMesh
from dtrain.parallelize.options import ParallelizeOptions
from dtrain.parallelize.parallel_dims import ParallelDims
from dtrain.parallelize.pipeline_plan import PipelinePlan
from dtrain.parallelize.tensor_parallel import TPPlan
from dtrain.parallelize.torch_compat import SPLIT_BACKWARD_RUNS_CUSTOM_FUNCTIONS

# The sum of the terms added to a microbatch's training objective, read from model parts after their forward.
ExtraLoss = Callable[[list[nn.Module]], torch.Tensor | None]
# How many such terms model parts hold (the objective takes the mean of all of the model's terms).
ExtraLossTerms = Callable[[list[nn.Module]], int]
# Work on this rank's model parts after every optimizer step.
OptimizerStepHook = Callable[[list[nn.Module]], None]
# A family's own metrics of a step (0-dim tensors by name, read off the model parts without a host sync).
StepMetrics = Callable[[list[nn.Module]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class FamilySpec:
    """Everything the trainer needs of a family.

    - ``model``: builds, sizes, counts and converts its models (``dtrain.models.family``);
    - ``parallelize(model, mesh, dims, options)``: applies TP, AC, compile and data parallel in place, to a whole
      model or a pipeline stage (the pipeline split itself is shared, through the decoder protocol);
    - ``tp_plan(sequence_parallel=, loss_parallel=)``: the tensor-parallel plan, as data, for the log;
    - ``tp_sizes(args)``: every size tensor parallel must divide, by the config key (or description) to name.

    Optional step hooks (None: the family needs none). Both run inside ``train_step``, so they must not read
    tensors on the host (no ``.item()``, no ``if tensor``):

    - ``extra_loss(model_parts)``: the sum of the terms these parts add to the objective after each microbatch's
      forward (e.g. the MoE layers' auxiliary load-balancing losses, from statistics the routers kept during that
      forward), or None for none this time; ``extra_loss_terms(model_parts)`` says how many terms the parts hold
      (default 1, which suits a single term only where the model is not pipelined).
      The objective gets the mean over all the model's terms, weighted so that it counts once per optimizer step
      (the mean over the step's microbatches; a term is this rank's share, and the shares add up over the
      data-parallel ranks). Under pipeline parallelism each stage adds its terms to its own backward. The
      reported ``loss`` stays the cross-entropy alone; the step reports the extra term as ``aux_loss``.
    - ``after_optimizer_step(model_parts)``: called right after every optimizer step, before the gradients are
      cleared (e.g. DeepSeek-V3's loss-free load balancing, which moves each expert's routing bias by its load).
    - ``step_metrics(model_parts)``: the family's metrics of the step just taken (e.g. MoE load imbalance), added
      to the step's metrics: metrics.jsonl and TensorBoard record them at every logged step.
    - ``extra_loss_enabled(args)``: whether a model of these args adds an extra loss at all (only then is a
      schedule that torch cannot run with it refused, ``check_hooks``).
    """

    model: ModelFamily
    parallelize: Callable[[nn.Module, ParallelMesh | None, ParallelDims, ParallelizeOptions], nn.Module]
    tp_plan: Callable[..., TPPlan]
    tp_sizes: Callable[[DecoderArgs], dict[str, int]]
    extra_loss: ExtraLoss | None = None
    extra_loss_terms: ExtraLossTerms = lambda model_parts: 1
    after_optimizer_step: OptimizerStepHook | None = None
    extra_loss_enabled: Callable[[DecoderArgs], bool] = lambda args: True
    step_metrics: StepMetrics | None = None

    @property
    def name(self) -> str:
        return self.model.name

    def check_shapes(self, dims: ParallelDims, args: DecoderArgs, seq_len: int) -> None:
        """A one-line ParallelismError when the degrees cannot split this model's shapes."""
        dims.check_tp_divides({**self.tp_sizes(args), **moe_tp_sizes(args)}, seq_len)
        check_moe_layout(dims, args)

    def check_hooks(self, plan: PipelinePlan | None, args: DecoderArgs | None = None) -> None:
        """A one-line ParallelismError when the pipeline of `plan` (None: none) cannot run the family's step hooks
        for a model of `args` (None: any model of the family)."""
        enabled = args is None or self.extra_loss_enabled(args)
        if self.extra_loss is None or not enabled or plan is None:
            return
        # A stage adds the extra term to its backward through a custom autograd Function (pipeline_extra_loss.py).
        if plan.split_backward and not SPLIT_BACKWARD_RUNS_CUSTOM_FUNCTIONS:
            raise ParallelismError(
                f"model family {self.name} adds an extra loss term, which torch {torch.__version__} cannot run "
                f"under parallelism.pipeline_parallel_schedule={plan.schedule} (it splits the backward); use "
                "1F1B, Interleaved1F1B, GPipe or LoopedBFS, or torch >= 2.13"
            )


def moe_tp_sizes(args: DecoderArgs) -> dict[str, int]:
    """What tensor parallel splits in MoE layers (``args.moe``, models/moe.py): the shared experts' hidden units.
    The router and the routed experts stay whole on every TP rank (decoder_plan.py, ``decoder_tp_plan``)."""
    moe = args.moe
    if moe is None or not moe.num_shared_experts:
        return {}
    return {"the MoE shared experts' hidden size": moe.hidden_dim * moe.num_shared_experts}


def check_moe_layout(dims: ParallelDims, args: DecoderArgs) -> None:
    """Expert parallel needs MoE layers (``args.moe``, models/moe.py) whose experts it can split evenly."""
    moe = args.moe
    if dims.ep_enabled and moe is None:
        raise ParallelismError(
            f"parallelism.expert_parallel_degree={dims.ep} needs a model with MoE layers; this one has none "
            "(valid: 1)"
        )
    if dims.ep_enabled and moe.num_experts % dims.ep:
        raise ParallelismError(
            f"parallelism.expert_parallel_degree={dims.ep} does not divide the model's {moe.num_experts} experts"
        )
