"""TrainState: everything that changes during training, in one object that DCP saves and loads as a unit, beside
`StepSetup`, the frozen part the step reads but never changes (executor, seed, clipping, rank coordinates).

Nothing that affects the next step lives outside it (docs/architecture.md, "Following one step"). Random streams are not saved because they are
derived from (seed, step, coordinates) at every step (see rng.py), so `seed` and `step` are the whole RNG state.

The saved keys do not depend on the parallel layout, so that a checkpoint reshards: model weights and optimizer
state are keyed by the model's own parameter names (pipeline stages keep full-model names), and of the LR
schedule only its position is kept (its per-group lists would change length with the layout).

`RankCoordinates` is the one piece of the layout the step needs (this rank's data-parallel and context-parallel
place and reductions), as plain data: the layout (run/layout.py) computes it from the mesh, the state's
setup carries it, and it is never saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

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

from dtrain.step.optimizer import OptimizersContainer
from dtrain.step.replica_sync import OneGroup, ReplicaSync

if TYPE_CHECKING:
    from dtrain.step.executor import StepExecutor

# Optimizer state keyed "state.<param fqn>.<name>" / "param_groups.<param fqn>.<name>": no layout-dependent indices.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
# Each model part holds only its own keys of the merged model dict (pipeline stages), hence strict=False.
PART = StateDictOptions(strict=False)


@dataclass(frozen=True)
class RankCoordinates:
    """This rank's place among the others: what its data and its step's reductions depend on."""

    pp_rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    # Keys of this rank's random streams (rng.py), so that data-parallel ranks draw different ones.
    rng_coords: tuple = ()
    # Sums over the ranks that hold different tokens (data × context parallel).
    reduce_over_dp: Callable[[torch.Tensor], torch.Tensor] = field(default=lambda t: t)
    # Context parallel: how many ranks share each sequence, and this rank's part of a microbatch (None without).
    cp_size: int = 1
    shard_sequence: Callable[[dict], dict] | None = None


@dataclass(frozen=True)
class StepSetup:
    """What the step reads and never changes, fixed for the whole run: how it runs on this layout (`executor`,
    chosen once), the seed of its random streams, the clipping norm, training.skip_nonfinite_steps, this
    rank's coordinates (a world of one by default) and how it synchronises with other replica groups (one group by
    default; torchft's groups in a fault-tolerant run).
    Not saved, except the seed that a resume checks."""

    executor: StepExecutor
    seed: int
    max_norm: float
    skip_nonfinite_steps: int = 0
    rank: RankCoordinates = field(default_factory=RankCoordinates)
    replicas: ReplicaSync = field(default_factory=OneGroup)


@dataclass
class TrainState(Stateful):
    """The training state: what the step changes, and its fixed `setup`. `model_parts` is a list so that pipeline
    stages (several parts per rank) fit as is."""

    model_parts: list[nn.Module]
    optimizer: OptimizersContainer
    lr_scheduler: torch.optim.lr_scheduler.LambdaLR
    dataloader: Stateful
    setup: StepSetup
    step: int = 0
    tokens_seen: int = 0
    # How many steps this launch has skipped of setup.skip_nonfinite_steps (a budget per launch: not saved).
    skipped_steps: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": {k: v for part in self.model_parts for k, v in get_model_state_dict(part).items()},
            "optimizer": {
                k: v
                for part, optimizer in zip(self.model_parts, self.optimizer.optimizers)
                for k, v in get_optimizer_state_dict(part, optimizer, options=FLAT).items()
            },
            "lr_scheduler": {"last_epoch": self.lr_scheduler.last_epoch},
            "dataloader": self.dataloader.state_dict(),
            "train": {"step": self.step, "tokens_seen": self.tokens_seen, "seed": self.setup.seed},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, optimizer in zip(self.model_parts, self.optimizer.optimizers):
            set_model_state_dict(part, state_dict["model"], options=PART)
            set_optimizer_state_dict(part, optimizer, state_dict["optimizer"], options=FLAT)
        self.set_lr_schedule_position(int(state_dict["lr_scheduler"]["last_epoch"]))
        self.dataloader.load_state_dict(state_dict["dataloader"])
        self.step = int(state_dict["train"]["step"])
        self.tokens_seen = int(state_dict["train"]["tokens_seen"])

    def set_lr_schedule_position(self, last_epoch: int) -> None:
        """Move the LR schedule to `last_epoch` and give every parameter group the rate it implies."""
        scheduler = self.lr_scheduler
        scheduler.last_epoch = last_epoch
        rates = [base * fn(last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, rate in zip(self.optimizer.param_groups, rates):
            group["lr"] = rate
        # Copies, as LambdaLR keeps them: torchao's optimizers hold the rate as a tensor that the next schedule
        # step overwrites in place, and the step reports the rate it used.
        scheduler._last_lr = [rate.clone() if isinstance(rate, torch.Tensor) else rate for rate in rates]

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.model_parts for p in part.parameters()]
