"""Running a batch through the pipeline: stages, the torch.distributed.pipelining schedule, loss and clipping.

The trainer's loss math is kept exactly (dtrain/step/train_step.py): the schedule gets a loss function that
multiplies each microbatch's summed cross-entropy by the step's gradient scale and is told not to rescale
gradients itself (``scale_grads=False``), so a pipeline reproduces the single-process gradients whatever the
number of microbatches. For the zero-bubble and V schedules ``build_pipeline`` keeps every FSDP unit's
parameters gathered between forward and backward (torch 2.13 otherwise gives silently wrong gradients).
A family's extra loss term enters each stage's own backward (pipeline_extra_loss.py). Validation runs a second
schedule of the same kind over the same stage modules (``Pipeline.evaluate``), since switching one schedule
between ``step`` and ``eval`` re-runs its set-up and a validation batch may have other shapes.

See docs/parallelism.md, "Loss, gradients and clipping" and "Findings: zero-bubble schedules with FSDP2, and PP
with DDP".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from dtrain.parallelize.errors import ParallelismError
from dtrain.parallelize.grad_norm import total_grad_norm
from dtrain.parallelize.pipeline_extra_loss import StageExtraLoss, shape_inference
from dtrain.parallelize.pipeline_plan import SINGLE_STAGE_SCHEDULES, PipelinePlan
from dtrain.parallelize.pipeline_split import StageModule
from dtrain.parallelize.torch_compat import PipelineStageWithForwardOnlyHandoff, clip_grads_with_norm_

SCHEDULE_CLASSES = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}


class ScaledLoss:
    """The schedule's loss function: the trainer's summed loss times the gradient scale of the current step."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.grad_scale: torch.Tensor | float = 1.0

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) * self.grad_scale

    def unrecorded(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The same loss for a run that is no microbatch's (a stage's metadata inference, on placeholder inputs):
        a loss function that keeps records besides its value (a mixture's per-source sums) has an `unrecorded`
        form that keeps none."""
        return getattr(self.loss_fn, "unrecorded", self.loss_fn)(output, target) * self.grad_scale


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them; ``step`` is what the training step calls."""

    plan: PipelinePlan
    stages: list[StageModule]
    schedule: object  # a torch.distributed.pipelining schedule (their common base class is private)
    loss: ScaledLoss
    pp_group: dist.ProcessGroup
    device: torch.device = torch.device("cpu")
    extra_loss: StageExtraLoss | None = None
    # Forward-only schedules of validation, by (batch size, sequence length): built on first use.
    eval_schedules: dict[tuple[int, int], object] = field(default_factory=dict)

    @property
    def model_parts(self) -> list[nn.Module]:
        """The stage modules, for the optimizer and the checkpoint (their parameter names are full-model names)."""
        return [stage.module for stage in self.stages]

    @property
    def has_first_stage(self) -> bool:
        return self.stages[0].index == 0

    @property
    def has_last_stage(self) -> bool:
        return self.stages[-1].index == self.plan.num_stages - 1

    def step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        grad_scale: torch.Tensor | float,
        document_ids: torch.Tensor | None = None,
        extra_loss_weight: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one batch (split into the plan's microbatches); gradients accumulate.

        Returns the batch's summed loss, unscaled, and the mean over the plan's microbatches of the family's extra
        loss term (summed over the stages; 0 without one), on every pipeline rank (all-reduced from the ranks that
        hold them), so that every rank logs the same values. Each microbatch's extra term enters backward times
        ``extra_loss_weight / n_microbatches``: the batch's term counts as their mean. Run it inside the trainer's
        loss context (loss parallel under TP), which the last stage's loss and backward need. `document_ids`
        (document masking) reaches every stage's forward: the schedule splits keyword arguments into microbatches
        like the inputs and hands them to each stage, not only the first.
        """
        self.loss.grad_scale = grad_scale
        if self.extra_loss is not None:
            self.extra_loss.start(extra_loss_weight / self.plan.n_microbatches)
        losses: list[torch.Tensor] = []
        # A stage checks each microbatch against the shapes and strides it inferred from a contiguous example
        # (torch 2.11 compares strides too), so a batch that is a view, e.g. inputs cut from a window of
        # seq_len + 1 tokens, is refused unless made contiguous. A no-op for the data loader's batches.
        args = (input_ids.contiguous(),) if self.has_first_stage else ()
        target = labels.contiguous() if self.has_last_stage else None
        kwargs = {"document_ids": document_ids.contiguous()} if document_ids is not None else {}
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if losses:
            loss_sum = torch.stack([loss.detach() for loss in losses]).sum() / grad_scale
        else:
            loss_sum = torch.zeros((), device=input_ids.device)
        extra = (
            self.extra_loss.total(loss_sum.device) / self.plan.n_microbatches
            if self.extra_loss is not None
            else torch.zeros_like(loss_sum)
        )
        totals = torch.stack([loss_sum, extra])
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.pp_group)
        return totals[0], totals[1]

    def evaluate(
        self, input_ids: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forward only of one batch (``Schedule.eval``, split into microbatches of the plan's size): its summed
        loss on every pipeline rank, as ``step`` returns it. Call it under ``torch.no_grad()``, in the loss context.
        """
        schedule = self._eval_schedule(input_ids.shape[0], input_ids.shape[1])
        losses: list[torch.Tensor] = []
        args = (input_ids.contiguous(),) if self.has_first_stage else ()
        target = labels.contiguous() if self.has_last_stage else None
        kwargs = {"document_ids": document_ids.contiguous()} if document_ids is not None else {}
        schedule.eval(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        loss_sum = torch.stack(losses).sum() if losses else torch.zeros((), device=input_ids.device)
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM, group=self.pp_group)
        return loss_sum

    def _eval_schedule(self, batch_size: int, seq_len: int) -> object:
        """The plan's schedule class over new stage objects that wrap the same modules, with an unscaled loss."""
        key = (batch_size, seq_len)
        if key not in self.eval_schedules:
            if batch_size % self.plan.microbatch_size:
                raise ParallelismError(
                    f"a validation batch of {batch_size} sequences does not split into pipeline microbatches of "
                    f"parallelism.pipeline_parallel_microbatch_size={self.plan.microbatch_size}"
                )
            self.eval_schedules[key] = new_schedule(
                self.plan, self.stages, self.pp_group, self.device, self.loss.loss_fn,
                n_microbatches=batch_size // self.plan.microbatch_size,
            )
        return self.eval_schedules[key]

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """The gradient norm over all stages of the pipeline, clipped to `max_norm` (see below)."""
        return clip_grad_norm_across_stages(parameters, max_norm, self.pp_group)


def keep_parameters_gathered(stages: list[StageModule]) -> None:
    """Turn off FSDP2's reshard-after-forward in every unit of the stages (see the module doc)."""
    for stage in stages:
        for module in stage.module.modules():
            if isinstance(module, FSDPModule):
                module.set_reshard_after_forward(False)


class StatelessInferenceStage(PipelineStageWithForwardOnlyHandoff):
    """A pipeline stage whose shape inference leaves the stage's buffers as they were.

    Before its first step a stage learns its input and output shapes by running its module once, on the first
    microbatch (first stage) or on empty tensors of the received shapes (torch 2.13's ``_forward_metadata_inference``,
    torch 2.11's ``_shape_inference``). A module that keeps statistics in buffers would count that run as
    training: an MoE layer's token counts (models/moe.py), which then move its loss-free balancing bias otherwise
    than one process would. The buffers are restored after the inference run, and it adds no extra loss term.
    torch 2.13 also runs the last stage's loss once to infer the gradients' shapes: through its `unrecorded` form.
    """

    def _backward_metadata_inference(self, loss_fn=None, **kwargs):
        return super()._backward_metadata_inference(loss_fn=getattr(loss_fn, "unrecorded", loss_fn), **kwargs)

    def _forward_metadata_inference(self, *args, **kwargs):
        with _buffers_restored(self.submod), shape_inference(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

    def _shape_inference(self, *args, **kwargs):
        with _buffers_restored(self.submod), shape_inference(self.submod):
            return super()._shape_inference(*args, **kwargs)


@contextlib.contextmanager
def _buffers_restored(module: nn.Module):
    saved = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def build_pipeline(
    plan: PipelinePlan,
    stages: list[StageModule],
    *,
    pp_group: dist.ProcessGroup,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    extra_loss: StageExtraLoss | None = None,
) -> Pipeline:
    """The schedule over this rank's (parallelized, materialized) stages, communicating over `pp_group`.

    `loss_fn(output, labels)` is the trainer's summed loss (as ``build_step_executor`` gets it); `extra_loss`
    the family's extra term, already hooked into the stages (None: none).
    """
    pp_rank, pp_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    if pp_size != plan.pp or tuple(s.index for s in stages) != plan.stage_indices(pp_rank):
        raise ParallelismError(
            f"pipeline rank {pp_rank} of {pp_size} got stages {[s.index for s in stages]}, but the plan gives it "
            f"{list(plan.stage_indices(pp_rank))} of a {plan.pp}-rank pipeline"
        )
    if plan.split_backward:
        keep_parameters_gathered(stages)
    loss = ScaledLoss(loss_fn)
    schedule = new_schedule(plan, stages, pp_group, device, loss, n_microbatches=plan.n_microbatches)
    return Pipeline(
        plan=plan, stages=stages, schedule=schedule, loss=loss, pp_group=pp_group, device=device, extra_loss=extra_loss
    )


def new_schedule(
    plan: PipelinePlan,
    stages: list[StageModule],
    pp_group: dist.ProcessGroup,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    n_microbatches: int,
) -> object:
    """A schedule of the plan's kind over new pipeline stages that wrap the modules of `stages`."""
    pipeline_stages = [
        StatelessInferenceStage(stage.module, stage.index, plan.num_stages, device, group=pp_group)
        for stage in stages
    ]
    # Single-stage schedules take the stage itself, multi-stage schedules the list of this rank's stages.
    single = plan.schedule in SINGLE_STAGE_SCHEDULES
    return SCHEDULE_CLASSES[plan.schedule](
        pipeline_stages[0] if single else pipeline_stages,
        n_microbatches=n_microbatches,
        loss_fn=loss_fn,
        scale_grads=False,
    )


def clip_grad_norm_across_stages(
    parameters: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup
) -> torch.Tensor:
    """The 2-norm of all gradients of all stages, clipping every stage to `max_norm` unless it is 0.

    Each rank holds only its stages' gradients: the squares of the local norms are summed over the pipeline
    ranks, so every rank computes (and clips with) the same total as a single process would.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    local_norm = total_grad_norm(grads)
    if isinstance(local_norm, DTensor):
        local_norm = local_norm.full_tensor()  # the norm over the data/tensor-parallel shards of these stages
    squared = local_norm**2
    dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=pp_group)
    total_norm = squared.sqrt()
    if max_norm > 0:
        clip_grads_with_norm_(parameters, max_norm, total_norm)
    return total_norm
