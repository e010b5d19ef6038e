"""A family's extra loss term (the MoE auxiliary loss) under pipeline parallel: each stage adds its own terms to
its own backward.

A pipeline has no one objective, so a stage's output carries its terms (``AddToBackward``: the identity forward,
whose backward passes the output's gradient on and gives the term the gradient 1, the weight folded into the
term); the stage's backward then adds the term's gradient to its parameters' and to the input gradient it sends
back: by the chain rule, exactly one process's gradient (docs/parallelism.md, "Loss, gradients and clipping").
torch 2.11's split-backward schedules cannot run a custom autograd Function in a stage (torch_compat.py), so
``FamilySpec.check_hooks`` refuses them there while an extra loss is on. The terms' values are kept for the log:
their mean over the microbatches, summed over the stages (``Pipeline.step``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
from torch import nn

from dtrain.parallelize.pipeline_split import StageModule

SHAPE_INFERENCE_ATTR = "_dtrain_shape_inference"


class AddToBackward(torch.autograd.Function):
    """``output`` unchanged (a copy with `copy`, else a view); in backward, ``term`` gets the gradient 1 whatever
    the output's gradient is."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, term: torch.Tensor, copy: bool) -> torch.Tensor:
        ctx.term_like = (term.shape, term.dtype, term.device)
        return output.clone() if copy else output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device = ctx.term_like
        return grad, torch.ones(shape, dtype=dtype, device=device), None


class StageExtraLoss:
    """Adds ``extra_loss([stage]) / terms * weight`` to the backward of each of this rank's stages (`terms`: how
    many terms the whole model's extra loss has, over all stages; ``weight``: set for each batch by the pipeline).

    A stage's output is handed on as a copy except on the last stage (whose output, the logits, goes into the
    loss): the split-backward schedules detach the outputs of the other stages in place, which a view forbids.
    """

    def __init__(
        self,
        extra_loss: Callable[[list[nn.Module]], torch.Tensor | None],
        stages: list[StageModule],
        terms: int,
        num_stages: int,
    ) -> None:
        self.extra_loss = extra_loss
        self.terms = terms
        self.weight = 0.0
        self.values: list[torch.Tensor] = []
        for stage in stages:
            copy = stage.index != num_stages - 1
            stage.module.register_forward_hook(functools.partial(self._add_to_backward, copy=copy))

    def _add_to_backward(
        self, module: nn.Module, args: tuple, output: torch.Tensor, *, copy: bool
    ) -> torch.Tensor | None:
        if getattr(module, SHAPE_INFERENCE_ATTR, False):
            return None  # the schedule learning shapes: no microbatch of the step
        term = self.extra_loss([module])
        if term is None:
            return None
        term = term / self.terms
        self.values.append(term.detach())
        return AddToBackward.apply(output, term * self.weight, copy)

    def start(self, weight: float) -> None:
        """Before a batch: its terms enter backward times `weight`."""
        self.weight = weight
        self.values.clear()

    def total(self, device: torch.device) -> torch.Tensor:
        """The sum of this rank's terms since ``start``."""
        return torch.stack(self.values).sum() if self.values else torch.zeros((), device=device)


@contextlib.contextmanager
def shape_inference(module: nn.Module):
    """Inside, `module` (a stage) runs to learn shapes: its forward adds no extra term."""
    setattr(module, SHAPE_INFERENCE_ATTR, True)
    try:
        yield
    finally:
        delattr(module, SHAPE_INFERENCE_ATTR)
