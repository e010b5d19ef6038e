"""Divergence: a non-finite loss or gradient norm stops the run, naming the step, and nothing after it is saved.

Without it a diverged run trains on NaN weights, exits 0 and commits NaN checkpoints, which retention then prefers
to the good ones. The guard records on the device the first step whose loss or gradient norm was not finite
(no host read per step) and the loop reads that record where it reads the device anyway, at log steps, and before
every save and at the end: a diverged state is never committed and the run ends with one line and exit 1. All
ranks agree on the step (MIN over the world), so they stop together.

`training.skip_nonfinite_steps = N` (spike-tolerant runs) makes the step itself check every step (one host read)
and skip the update of up to N such steps; the next one stops the run at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtrain.errors import DtrainError

NO_STEP = torch.iinfo(torch.int64).max


class Diverged(DtrainError):
    """The loss or gradient norm stopped being finite."""


def local_value(value: torch.Tensor) -> torch.Tensor:
    """This rank's part of a metric: a DTensor's non-finite local part makes the whole non-finite."""
    return value.to_local() if isinstance(value, DTensor) else value


def is_finite(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """A device bool: both the loss and the gradient norm are finite (no host read)."""
    return torch.isfinite(loss) & torch.isfinite(local_value(grad_norm))


def finite_on_every_rank(loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
    """Whether the step is finite on every rank (a host read, and a collective when distributed), so that all
    ranks skip the same steps."""
    finite = is_finite(loss, grad_norm).to(torch.int32)
    if dist.is_initialized():
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite)


def diverged_message(step: int, loss: float | None, grad_norm: float | None) -> str:
    values = f"loss {loss:.4g}, grad_norm {grad_norm:.4g}" if loss is not None else "not finite on another rank"
    return (
        f"training diverged at step {step} ({values}); stopped without saving it. Lower optimizer.lr or raise "
        "lr_scheduler.warmup_steps, or set training.skip_nonfinite_steps to skip such steps"
    )


class NonFiniteGuard:
    """The first non-finite step of this run, kept on the device until `check` reads it."""

    def __init__(self, device: torch.device) -> None:
        self._first = torch.full((), NO_STEP, dtype=torch.int64, device=device)
        self._values = torch.zeros(2, dtype=torch.float32, device=device)

    def record(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Remember `step` if it is the first whose loss or gradient norm is not finite (no host read)."""
        first_bad = ~is_finite(loss, grad_norm) & (self._first == NO_STEP)
        self._first = torch.where(first_bad, step, self._first)
        values = torch.stack([loss.detach().float(), local_value(grad_norm).detach().float()])
        self._values = torch.where(first_bad, values, self._values)

    def check(self) -> None:
        """Raise Diverged (on every rank) if any rank recorded a non-finite step; a collective when distributed."""
        first = self._first.clone()
        if dist.is_initialized():
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        step = int(first)
        if step == NO_STEP:
            return
        mine = int(self._first) == step
        loss, grad_norm = self._values.tolist() if mine else (None, None)
        raise Diverged(diverged_message(step, loss, grad_norm))
