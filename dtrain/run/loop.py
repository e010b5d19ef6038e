"""The training loop: fetch a batch, run `train_step`, run the hooks; until `training.steps` or preempted.

Everything else a step triggers (logging, validation, checkpoints, profiling, GC, ...) is a hook registered at
set-up (run/loop_hooks.py).
"""

from __future__ import annotations

import torch

from dtrain.metrics.liveness import doing
from dtrain.run.hooks import Hooks, StepEnd
from dtrain.step.state import TrainState
from dtrain.step.train_step import train_step


def run_loop(state: TrainState, steps: int, accumulation: int, device: torch.device, hooks: Hooks) -> bool:
    """Step until `steps` or until a hook marks the step preempted (then True)."""
    data = iter(state.dataloader)
    start_step = state.step
    stop = False
    retries = state.setup.replicas.may_discard  # replica groups may discard a step: it is retried on its batches
    with hooks.running():
        while state.step < steps and not stop:
            position = state.dataloader.state_dict() if retries else None
            batch = [to_device(next(data), device) for _ in range(accumulation)]
            first = state.step == start_step
            doing(f"in step {state.step + 1} of {steps}")
            with hooks.around_step(first):
                step_metrics = train_step(state, batch)
            doing(f"after step {state.step}: logging, validation, checkpoint")
            if step_metrics is None:  # discarded by the replica groups (fault tolerance)
                state.dataloader.load_state_dict(position)
                end = StepEnd(state.step, {}, state.tokens_seen, first=first, last=False)
                hooks.after_discarded(end)
            else:
                end = StepEnd(state.step, step_metrics, state.tokens_seen, first=first, last=state.step == steps)
                hooks.after_step(end)
            stop = end.preempted
    return stop


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
