"""The training step: a function of (state, batch) that returns metrics as tensors, with no host sync inside.

How forward, backward and clipping run on this layout (the whole model here, or a pipeline schedule over this
rank's stages) is the state's executor (executor.py), chosen once; this file is the same on every layout.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from dtrain.step.nonfinite import (
    Diverged,
    diverged_message,
    finite_on_every_rank,
    local_value,
)
from dtrain.step.rng import seed_everything
from dtrain.step.state import TrainState

IGNORE_INDEX = -100
logger = logging.getLogger("dtrain")


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32; the step divides by the global count of valid tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def train_step(state: TrainState, microbatches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One optimizer step over this rank's microbatches (gradient accumulation when there are several).

    The loss is normalised by the number of valid tokens in the whole global batch, not per microbatch, so the
    same global batch gives the same loss and gradient however it is split over microbatches and ranks.
    ``loss`` is that cross-entropy alone (as torchtitan logs it); a family's extra loss term (the MoE auxiliary
    loss) is reported apart as ``aux_loss``, and the objective is their sum.
    """
    seed_everything(state.seed, "step", state.step, *state.rank.rng_coords)
    rank = state.rank
    if rank.shard_sequence is not None:  # context parallel: this rank's tokens of every sequence
        microbatches = [rank.shard_sequence(mb) for mb in microbatches]
    local_tokens = sum((mb["labels"] != IGNORE_INDEX).sum() for mb in microbatches)
    global_tokens = rank.reduce_over_dp(local_tokens)
    # Data-parallel gradient reduction averages over the dp (and cp) ranks; scaling by their number turns that
    # average into the sum that a division by the global token count needs.
    grad_scale = rank.dp_size * rank.cp_size / global_tokens
    # A family's extra loss term counts once per step: the mean over the microbatches. Each rank computes its
    # share of a microbatch's term (models/moe.py); the shares' gradients are averaged like the loss's, so the
    # same dp x cp factor turns that average into their sum.
    extra_loss_weight = rank.dp_size * rank.cp_size / len(microbatches)
    loss_sum = torch.zeros((), device=global_tokens.device)
    extra_sum = torch.zeros((), device=global_tokens.device)
    for mb in microbatches:
        mb_loss, mb_extra = state.executor.forward_backward(state.model_parts, mb, grad_scale, extra_loss_weight)
        loss_sum += mb_loss
        extra_sum += mb_extra
    grad_norm = state.executor.clip_grad_norm(state.parameters, state.max_norm)
    totals = rank.reduce_over_dp(torch.stack([loss_sum, extra_sum]))
    loss = totals[0] / global_tokens
    extra_metrics = {"aux_loss": totals[1] / len(microbatches)} if state.executor.has_extra_loss else {}
    # Only under training.skip_nonfinite_steps does the step read the device (see nonfinite.py).
    if state.skip_nonfinite_steps == 0 or finite_on_every_rank(loss, grad_norm):
        state.optimizer.step()
        state.executor.after_optimizer_step(state.model_parts)
    else:
        skip_update(state, loss, grad_norm)
    state.optimizer.zero_grad(set_to_none=True)
    lr = state.lr_scheduler.get_last_lr()[0]
    state.lr_scheduler.step()
    state.step += 1
    state.tokens_seen += sum(mb["input_ids"].numel() for mb in microbatches) * rank.dp_size * rank.cp_size
    return {
        "loss": loss, **extra_metrics, "grad_norm": grad_norm, "lr": lr,
        **state.executor.step_metrics(state.model_parts),
    }


def skip_update(state: TrainState, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
    """Leave the weights and optimizer state of a non-finite step as they were, or stop once the budget is spent."""
    step, values = state.step + 1, (float(loss), float(local_value(grad_norm)))
    if state.skipped_steps >= state.skip_nonfinite_steps:
        raise Diverged(diverged_message(step, *values))
    state.skipped_steps += 1
    logger.warning(
        "step %d: loss %.4g, grad_norm %.4g not finite; update skipped (%d of training.skip_nonfinite_steps = %d)",
        step, *values, state.skipped_steps, state.skip_nonfinite_steps,
    )
