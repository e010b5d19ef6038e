"""How a step is synchronised with other replica groups, as a strategy chosen once per run (as step/executor.py
is for pipelines): `OneGroup` for an ordinary run, torchft's per-step or semi-synchronous groups for a
fault-tolerant one (fault_tolerance/replica_groups.py). The Protocol keeps step/ free of the layers above it."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class ReplicaSync(Protocol):
    participants: int  # replica groups that took part in the last step (or synchronization)
    may_discard: bool  # whether a step can be discarded (the loop then keeps the data position to retry it)
    lost: Exception | None  # what ends this group after a discarded attempt (its quorum lost), else None

    def start_step(self) -> bool:
        """Join this step's quorum of groups before the forward (a (re)joining group takes a live peer's state).
        False: this attempt cannot run (the groups are not all here yet, or the quorum was lost): discard it."""

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the groups of this step (in place; itself between semi-synchronous syncs)."""

    def reduce_gradients(self, parameters: list[nn.Parameter]) -> None:
        """Sum this rank's gradients with those of the same rank in the other groups (nothing when semi-sync)."""

    def should_commit(self) -> bool:
        """Whether every group of the quorum got through the step: False discards it (no optimizer step)."""

    def metrics(self) -> dict[str, float]:
        """What the step logs of the groups: participating groups, recoveries, seconds recovering, discarded steps."""


class OneGroup:
    """An ordinary run: one group, nothing to agree on, every step commits."""

    participants = 1
    may_discard = False
    lost = None

    def start_step(self) -> bool:
        return True

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def reduce_gradients(self, parameters: list[nn.Parameter]) -> None:
        pass

    def should_commit(self) -> bool:
        return True

    def metrics(self) -> dict[str, float]:
        return {}
