"""How a training step runs forward, backward and gradient clipping on this rank: an executor chosen once.

`train_step` is the same code on every layout. What differs is whether this rank runs its whole model
(`LocalExecutor`: every layout without pipeline parallelism) or hands each microbatch to the pipeline schedule over
its stages (`PipelineExecutor`); the trainer picks one when it builds the state (run/build_state.py). An
executor holds no training state: the model parts and parameters come from the `TrainState` on every call.
`evaluate` is the forward-only path of validation (run/validation.py) on the same layout.

A family's optional step hooks (`FamilySpec.extra_loss`, `after_optimizer_step`) run here, so the step never
names a family; the extra loss is the mean over all the model's terms, counted once when the executor is built
(parallelize/pipeline_extra_loss.py under pipeline parallel). A mixture's loss is also summed by source
(step/source_loss.py, `source_loss_sums`). Nothing here reads a tensor on the host.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from dtrain.parallelize.family_spec import ExtraLoss, OptimizerStepHook, StepMetrics
from dtrain.parallelize.grad_norm import total_grad_norm
from dtrain.parallelize.pipeline_schedule import Pipeline
from dtrain.parallelize.torch_compat import clip_grads_with_norm_
from dtrain.step.source_loss import SourceLoss

Microbatch = dict[str, torch.Tensor]


class Loss(Protocol):
    """What an executor needs of the step's loss (train_step.py's `StepLoss`, which it does not import: the step
    imports the state, which holds the executor)."""

    sources: SourceLoss | None  # a dataset mixture's loss by source (None: no mixture)

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The summed loss of `output` against `target` (see `target`), a plain tensor."""

    def target(self, microbatch: Microbatch) -> torch.Tensor:
        """What the loss is given for `microbatch`: its labels, with the source ids of a mixture."""

    def count(self, microbatch: Microbatch) -> torch.Tensor:
        """What the step divides the summed loss by, this microbatch's part: label tokens, or preference pairs."""

    def context(self) -> contextlib.AbstractContextManager:
        """The context forward, loss and backward run in."""


@dataclass(frozen=True)
class StepExecutor(abc.ABC):
    """Forward/backward of one microbatch, the clipped gradient norm, and the work after the optimizer step.

    `loss` is the step's loss (forward, loss and backward run in its context: vocab-parallel cross-entropy under
    loss parallel); `optimizer_step_hook` is the family's `after_optimizer_step`, `metrics_hook` its
    `step_metrics`; `extra_loss_terms` the number of terms of the family's extra loss in the whole model (0: none).
    """

    loss: Loss
    optimizer_step_hook: OptimizerStepHook | None = field(default=None, kw_only=True)
    metrics_hook: StepMetrics | None = field(default=None, kw_only=True)
    extra_loss_terms: int = field(default=0, kw_only=True)

    @property
    def has_extra_loss(self) -> bool:
        return self.extra_loss_terms > 0

    @abc.abstractmethod
    def forward_backward(
        self, model_parts: list[nn.Module], microbatch: Microbatch, grad_scale: torch.Tensor, extra_loss_weight: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of `microbatch` (gradients accumulate); returns its summed loss and this rank's
        share of the family's extra loss term (the mean over the model's terms; 0 without one), detached.

        The summed loss enters backward times `grad_scale`, the extra term times `extra_loss_weight`.
        """

    @abc.abstractmethod
    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Total gradient norm (a tensor, possibly a DTensor), clipping to `max_norm` unless it is 0."""

    @abc.abstractmethod
    def evaluate(self, model_parts: list[nn.Module], microbatch: Microbatch) -> torch.Tensor:
        """Forward only of `microbatch` (call it under ``torch.no_grad()``): its summed loss, as `forward_backward`
        returns it, without a family's extra loss term."""

    def after_optimizer_step(self, model_parts: list[nn.Module]) -> None:
        if self.optimizer_step_hook is not None:
            self.optimizer_step_hook(model_parts)

    def step_metrics(self, model_parts: list[nn.Module]) -> dict[str, torch.Tensor]:
        return self.metrics_hook(model_parts) if self.metrics_hook is not None else {}

    def source_loss_sums(self, device: torch.device) -> torch.Tensor:
        """A mixture's summed loss by source over the microbatches since the last call (this rank's tokens)."""
        return self.loss.sources.take(device)


@dataclass(frozen=True)
class LocalExecutor(StepExecutor):
    """This rank runs its whole model (`model_parts[0]`), forward then backward."""

    extra_loss: ExtraLoss | None = None

    def forward_backward(
        self, model_parts: list[nn.Module], microbatch: Microbatch, grad_scale: torch.Tensor, extra_loss_weight: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with self.loss.context():
            output = model_parts[0](microbatch["input_ids"], document_ids=microbatch.get("document_ids"))
            loss = self.loss(output, self.loss.target(microbatch))
            objective = loss * grad_scale
            extra = self.extra_loss(model_parts) if self.has_extra_loss else None
            if extra is not None:
                extra = extra / self.extra_loss_terms
                objective = objective + extra * extra_loss_weight
            objective.backward()
        return loss.detach(), extra.detach() if extra is not None else torch.zeros_like(loss.detach())

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        return clip_grad_norm(parameters, max_norm)

    def evaluate(self, model_parts: list[nn.Module], microbatch: Microbatch) -> torch.Tensor:
        with self.loss.context():
            output = model_parts[0](microbatch["input_ids"], document_ids=microbatch.get("document_ids"))
            return self.loss(output, microbatch["labels"])


@dataclass(frozen=True)
class PipelineExecutor(StepExecutor):
    """The pipeline schedule runs this rank's stages (the modules of `model_parts`, and `loss`, bound when it was
    built); each stage adds its part of the family's extra loss term to its own backward."""

    pipeline: Pipeline

    def forward_backward(
        self, model_parts: list[nn.Module], microbatch: Microbatch, grad_scale: torch.Tensor, extra_loss_weight: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with self.loss.context():
            # The schedule splits the microbatch further, runs forward and backward over this rank's stages and
            # returns the summed loss and the extra term on every pipeline rank.
            return self.pipeline.step(
                microbatch["input_ids"], self.loss.target(microbatch), grad_scale,
                document_ids=microbatch.get("document_ids"), extra_loss_weight=extra_loss_weight,
            )

    def source_loss_sums(self, device: torch.device) -> torch.Tensor:
        # Only the rank of the last stage computed the loss: the others add zeros.
        sums = super().source_loss_sums(device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.pipeline.pp_group)
        return sums

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        # Each rank holds some stages' gradients; the norm spans all stages.
        return self.pipeline.clip_grad_norm(parameters, max_norm)

    def evaluate(self, model_parts: list[nn.Module], microbatch: Microbatch) -> torch.Tensor:
        with self.loss.context():
            return self.pipeline.evaluate(
                microbatch["input_ids"], microbatch["labels"], document_ids=microbatch.get("document_ids")
            )


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The 2-norm of the gradients of `parameters` (a DTensor when sharded), clipped to `max_norm` unless 0."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = total_grad_norm(grads)
    if max_norm > 0:
        clip_grads_with_norm_(parameters, max_norm, total_norm)
    return total_norm
