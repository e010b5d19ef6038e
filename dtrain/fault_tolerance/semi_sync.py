"""Semi-synchronous training over the replica groups: torchft's LocalSGD and DiLoCo around the step's optimizer.

Between synchronizations each group steps alone (no collective between groups); every `sync_steps` optimizer
steps, LocalSGD averages the weights over the groups of that quorum, and DiLoCo averages their change since the
last sync (the pseudo-gradient) and applies it with an outer SGD with Nesterov momentum (the DiLoCo paper's
outer optimizer, as torchtitan sets it). Both act in the optimizer's step hooks, so the step is unchanged; a group
behind the others recovers live at a sync.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from dtrain.config.schema_opt_in import FaultTolerance
from dtrain.step.state import TrainState


def semi_sync(ft: FaultTolerance, manager, state: TrainState) -> contextlib.AbstractContextManager:
    """The context the loop runs in: LocalSGD or DiLoCo over all this rank's model parts (nothing without)."""
    from torchft.local_sgd import DiLoCo, LocalSGD

    model = nn.ModuleList(state.model_parts)
    if ft.semi_sync_method == "local_sgd":
        return LocalSGD(manager, model, state.optimizer, sync_every=ft.sync_steps)
    if ft.semi_sync_method == "diloco":
        trainable = [p for p in model.parameters() if p.requires_grad]
        outer = torch.optim.SGD(trainable, lr=ft.outer_lr, momentum=ft.outer_momentum, nesterov=True)
        return DiLoCo(manager, [model], state.optimizer, outer, sync_every=ft.sync_steps)
    return contextlib.nullcontext()
