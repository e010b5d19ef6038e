"""TrainState: everything that changes during training, in one object that DCP saves and loads as a unit.

Nothing that affects the next step lives outside it (DESIGN §3). Each part is `Stateful`; random streams are not
saved because they are derived from (seed, step, coordinates) at every step (see rng.py), so `seed` and `step`
are the whole RNG state.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


@dataclass
class TrainState(Stateful):
    """The training state. `model_parts` is a list so that pipeline stages (several parts per rank) fit as is."""

    model_parts: list[nn.Module]
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    dataloader: Stateful
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    seed: int
    max_norm: float
    step: int = 0
    tokens_seen: int = 0
    # How the step talks to the rest of the world; set by the trainer from the parallel layout.
    dp_size: int = 1
    rng_coords: tuple = ()
    reduce_over_dp: Callable[[torch.Tensor], torch.Tensor] = field(default=lambda t: t)
    loss_context: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": {k: v for part in self.model_parts for k, v in get_model_state_dict(part).items()},
            "optimizer": get_optimizer_state_dict(self.model_parts, self.optimizer),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "dataloader": self.dataloader.state_dict(),
            "train": {"step": self.step, "tokens_seen": self.tokens_seen, "seed": self.seed},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.model_parts:
            # Each part holds only its own keys of the merged model dict (pipeline stages), hence strict=False.
            set_model_state_dict(part, state_dict["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(self.model_parts, self.optimizer, state_dict["optimizer"])
        self.lr_scheduler.load_state_dict(state_dict["lr_scheduler"])
        self.dataloader.load_state_dict(state_dict["dataloader"])
        self.step = int(state_dict["train"]["step"])
        self.tokens_seen = int(state_dict["train"]["tokens_seen"])

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.model_parts for p in part.parameters()]

