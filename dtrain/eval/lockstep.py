"""Forward calls in lockstep across the ranks of a sharded model, whatever share of the requests each rank holds.

Under FSDP2 every forward is a sequence of collectives (each layer's parameters are all-gathered), so every rank
must call the model as many times as every other. Evaluation's work is uneven: ranks hold different requests, whose
batches and generations differ in number and length. Before each forward every rank says whether it still has work
(one all-reduce); a rank that is done answers each round in which another still works with a one-token forward of
its own, until no rank works. A model whose parameters are all plain tensors (one process, or a replicated copy
per rank) needs none of this: its forwards are local.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter is a DTensor: the model's forward then runs collectives."""
    return any(isinstance(p, DTensor) for p in model.parameters())


class Lockstep:
    """Counts forward rounds for `model` over the default process group (when it is sharded); `filler` is the
    one-token input of a rank that has no work left in a round."""

    def __init__(self, model: nn.Module, filler: torch.Tensor) -> None:
        self.model, self.filler = model, filler
        self.active = dist.is_available() and dist.is_initialized() and is_sharded(model)

    def _others_working(self, working: bool) -> bool:
        flag = torch.tensor([int(working)], device=self.filler.device)
        dist.all_reduce(flag)
        return bool(flag.item())

    def before_forward(self) -> None:
        """Call before each forward of this rank's own work."""
        if self.active:
            self._others_working(True)

    def drain(self) -> None:
        """Call once this rank's work is done: fill the rounds of the ranks that still work."""
        if not self.active:
            return
        while self._others_working(False):
            with torch.no_grad():
                self.model(self.filler)


class LockstepModel(nn.Module):
    """`model` whose every forward first takes its lockstep round: what dtrain.models.decoding.generate calls, so
    that each generated token counts as a round (the KV cache still finds `model`'s attentions: it is a child)."""

    def __init__(self, model: nn.Module, lockstep: Lockstep) -> None:
        super().__init__()
        self.model = model
        self.lockstep = lockstep

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        self.lockstep.before_forward()
        return full_logits(self.model(tokens, positions))


def full_logits(output: torch.Tensor) -> torch.Tensor:
    """Plain logits: a tensor-parallel output head under loss parallel returns a DTensor sharded over the
    vocabulary."""
    return output.full_tensor() if isinstance(output, DTensor) else output
