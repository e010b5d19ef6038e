"""The training step: a function of (state, batch) that returns metrics as tensors, with no host sync inside."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtrain.parallelize.torch_compat import clip_grads_with_norm_
from dtrain.rng import seed_everything
from dtrain.state import TrainState

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32; the step divides by the global count of valid tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Total gradient norm (a tensor, possibly a DTensor), clipping to `max_norm` unless it is 0."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if max_norm > 0:
        clip_grads_with_norm_(parameters, max_norm, total_norm)
    return total_norm


def forward_backward(state: TrainState, microbatch: dict[str, torch.Tensor], grad_scale: torch.Tensor) -> torch.Tensor:
    """Forward and backward of one microbatch (gradients accumulate); returns its summed loss, detached."""
    with state.loss_context():
        if state.pipeline is not None:
            # The schedule splits the microbatch further, runs forward and backward over this rank's stages and
            # returns the summed loss on every pipeline rank.
            return state.pipeline.step(microbatch["input_ids"], microbatch["labels"], grad_scale)
        loss = state.loss_fn(state.model_parts[0](microbatch["input_ids"]), microbatch["labels"])
        (loss * grad_scale).backward()
    return loss.detach()


def train_step(state: TrainState, microbatches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One optimizer step over this rank's microbatches (gradient accumulation when there are several).

    The loss is normalised by the number of valid tokens in the whole global batch, not per microbatch, so the
    same global batch gives the same loss and gradient however it is split over microbatches and ranks.
    """
    seed_everything(state.seed, "step", state.step, *state.rng_coords)
    local_tokens = sum((mb["labels"] != IGNORE_INDEX).sum() for mb in microbatches)
    global_tokens = state.reduce_over_dp(local_tokens)
    # Data-parallel gradient reduction averages over dp ranks; scaling by dp_size turns that average into the
    # sum that a division by the global token count needs.
    grad_scale = state.dp_size / global_tokens
    loss_sum = torch.zeros((), device=global_tokens.device)
    for mb in microbatches:
        loss_sum += forward_backward(state, mb, grad_scale)
    # Under pipeline parallelism each rank holds some stages' gradients; the norm spans all stages.
    clip = state.pipeline.clip_grad_norm if state.pipeline is not None else clip_grad_norm
    grad_norm = clip(state.parameters, state.max_norm)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    lr = state.lr_scheduler.get_last_lr()[0]
    state.lr_scheduler.step()
    state.step += 1
    state.tokens_seen += sum(mb["input_ids"].numel() for mb in microbatches) * state.dp_size
    return {"loss": state.reduce_over_dp(loss_sum) / global_tokens, "grad_norm": grad_norm, "lr": lr}
