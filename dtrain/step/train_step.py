"""The training step: a function of (state, batch) that returns metrics as tensors, with no host sync inside.

The loss reads here whole: `cross_entropy_sum`, the `StepLoss` built once from it (compiled or not, vocab-parallel
or not), and the scales the step computes and passes with every microbatch. How forward, backward and clipping run
on this layout (the whole model, or a pipeline schedule over this rank's stages) is the executor of the state's
setup (executor.py), chosen once and given the `StepLoss` to call; this file is the same on every layout.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from dtrain.parallelize import ParallelDims, local_loss, loss_parallel_context
from dtrain.step.labels import IGNORE_INDEX
from dtrain.step.nonfinite import Diverged, diverged_message, finite_on_every_rank, local_value
from dtrain.step.rng import seed_everything
from dtrain.step.source_loss import SourceLoss
from dtrain.step.state import TrainState

logger = logging.getLogger("dtrain")


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32; the step divides by the global count of valid tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def cross_entropy_per_token(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy in fp32, one value per label (0 where ignored), flattened: a mixture's loss by source."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX)


@dataclass(frozen=True)
class StepLoss:
    """The summed loss the executor calls, built once for a run (`build`): `fn`, and the layout under whose loss
    parallel forward, loss and backward run (`dims`). The default is one process's eager `cross_entropy_sum`.
    With a dataset mixture, `sources` computes the loss of training batches, per source too (source_loss.py)."""

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum
    dims: ParallelDims | None = None
    sources: SourceLoss | None = None

    @classmethod
    def build(
        cls, dims: ParallelDims, compile_options: dict[str, Any] | None = None, source_names: tuple[str, ...] = ()
    ) -> StepLoss:
        """`cross_entropy_sum`, compiled with `compile_options` (None: eager). Under loss parallel the logits stay
        sharded over the vocabulary and the loss comes back as a DTensor, made a plain tensor so that the step can
        mix it with its token counts. `source_names` names a mixture's sources (empty: no mixture)."""

        def built(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
            if compile_options is not None:
                fn = torch.compile(fn, **compile_options)
            return local_loss(fn) if dims.loss_parallel_enabled else fn

        by_source = SourceLoss(source_names, built(cross_entropy_per_token), IGNORE_INDEX) if source_names else None
        return cls(built(cross_entropy_sum), dims, by_source)

    def target(self, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
        """What the executor passes the loss for `microbatch`: its labels (and source ids, in a mixture)."""
        return self.sources.target(microbatch) if self.sources is not None else microbatch["labels"]

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target.dim() == 3:  # labels and source ids (SourceLoss.target)
            return self.sources(output, target)
        return self.fn(output, target)

    @staticmethod
    def count(microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
        """What the step divides the summed loss by, this microbatch's part: its label tokens."""
        return (microbatch["labels"] != IGNORE_INDEX).sum()

    def unrecorded(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss without adding to a mixture's per-source sums: of a pipeline stage's metadata inference."""
        return self.fn(output, target[..., 0] if target.dim() == 3 else target)

    def context(self) -> contextlib.AbstractContextManager:
        """Vocab-parallel cross-entropy under loss parallel; nothing otherwise."""
        return loss_parallel_context(self.dims) if self.dims is not None else contextlib.nullcontext()


def train_step(state: TrainState, microbatches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """One optimizer step over this rank's microbatches (gradient accumulation when there are several).

    The loss is normalised by the count of the whole global batch (its valid tokens), so the same global batch
    gives the same loss and gradient however it is split over microbatches and ranks. ``loss`` is that loss alone
    (as torchtitan logs it); a family's extra term (the MoE auxiliary loss) is reported apart as ``aux_loss``.
    The step is synchronised with other replica groups by `setup.replicas`, a strategy chosen once (one group by
    default); a step they discard returns None (nothing changed but the data position).
    """
    setup = state.setup
    executor, rank, replicas = setup.executor, setup.rank, setup.replicas
    if not replicas.start_step():  # a group that was behind takes a live peer's state here, before its forward
        return None

    def sum_over_batch(tensor: torch.Tensor) -> torch.Tensor:
        return replicas.sum(rank.reduce_over_dp(tensor))

    seed_everything(setup.seed, "step", state.step, *rank.rng_coords)
    if rank.shard_sequence is not None:  # context parallel: this rank's tokens of every sequence
        microbatches = [rank.shard_sequence(mb) for mb in microbatches]
    global_tokens = sum_over_batch(sum(executor.loss.count(mb) for mb in microbatches))
    loss_sum, extra_sum = accumulate_gradients(state, microbatches, global_tokens)
    replicas.reduce_gradients(state.parameters)
    grad_norm = executor.clip_grad_norm(state.parameters, setup.max_norm)
    totals = sum_over_batch(torch.stack([loss_sum, extra_sum]))
    loss = totals[0] / global_tokens
    extra_metrics = {"aux_loss": totals[1] / len(microbatches)} if executor.has_extra_loss else {}
    if executor.loss.sources is not None:  # a dataset mixture: each source's loss and tokens (source_loss.py)
        extra_metrics.update(source_metrics(executor, microbatches, sum_over_batch, global_tokens.device))
    if not replicas.should_commit():
        state.optimizer.zero_grad(set_to_none=True)
        return None
    lr = apply_update(state, loss, grad_norm)
    tokens = sum(mb["input_ids"].numel() for mb in microbatches) * rank.dp_size * rank.cp_size
    state.tokens_seen += tokens * max(1, replicas.participants)
    return {
        "loss": loss, **extra_metrics, "grad_norm": grad_norm, "lr": lr,
        **executor.step_metrics(state.model_parts), **replicas.metrics(),
    }


def accumulate_gradients(
    state: TrainState, microbatches: list[dict[str, torch.Tensor]], global_count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of every microbatch: the summed loss and the summed extra term of this rank."""
    executor, rank = state.setup.executor, state.setup.rank
    # The executor scales the summed loss by `grad_scale` before backward. Data-parallel gradient reduction
    # averages over the dp (and cp) ranks; scaling by their number turns that average into the sum that a division
    # by the global count needs.
    grad_scale = rank.dp_size * rank.cp_size / global_count
    # A family's extra loss term counts once per step: the mean over the microbatches. Each rank computes its
    # share of a microbatch's term (models/moe.py); the shares' gradients are averaged like the loss's, so the
    # same dp x cp factor turns that average into their sum.
    extra_loss_weight = rank.dp_size * rank.cp_size / len(microbatches)
    loss_sum = torch.zeros((), device=global_count.device)
    extra_sum = torch.zeros((), device=global_count.device)
    for mb in microbatches:
        mb_loss, mb_extra = executor.forward_backward(state.model_parts, mb, grad_scale, extra_loss_weight)
        loss_sum += mb_loss
        extra_sum += mb_extra
    return loss_sum, extra_sum


def source_metrics(executor, microbatches: list[dict[str, torch.Tensor]], sum_over_batch: Callable,
                   device: torch.device) -> dict[str, torch.Tensor]:
    sources = executor.loss.sources
    return sources.step_metrics(executor.source_loss_sums(device), sources.tokens(microbatches), sum_over_batch)


def apply_update(state: TrainState, loss: torch.Tensor, grad_norm: torch.Tensor) -> float:
    """The optimizer and LR-schedule step of a committed step; returns the learning rate it used."""
    setup = state.setup
    # Only under training.skip_nonfinite_steps does the step read the device (see nonfinite.py).
    if setup.skip_nonfinite_steps == 0 or finite_on_every_rank(loss, grad_norm):
        state.optimizer.step()
        setup.executor.after_optimizer_step(state.model_parts)
    else:
        skip_update(state, loss, grad_norm)
    state.optimizer.zero_grad(set_to_none=True)
    lr = state.lr_scheduler.get_last_lr()[0]
    state.lr_scheduler.step()
    state.step += 1
    return lr


def skip_update(state: TrainState, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
    """Leave the weights and optimizer state of a non-finite step as they were, or stop once the budget is spent."""
    step, values = state.step + 1, (float(loss), float(local_value(grad_norm)))
    budget = state.setup.skip_nonfinite_steps
    if state.skipped_steps >= budget:
        raise Diverged(diverged_message(step, *values))
    state.skipped_steps += 1
    logger.warning(
        "step %d: loss %.4g, grad_norm %.4g not finite; update skipped (%d of training.skip_nonfinite_steps = %d)",
        step, *values, state.skipped_steps, budget,
    )
