"""What the step needs of the replica groups of a fault-tolerant run (fault_tolerance/replica_groups.py), as a
Protocol: step/ imports nothing of the layers above it."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class ReplicaSync(Protocol):
    participants: int  # replica groups that took part in the last step (or synchronization)

    def start_step(self) -> None:
        """Join this step's quorum of groups before the forward; a (re)joining group takes a live peer's state."""

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the groups of this step (in place; itself between semi-synchronous syncs)."""

    def reduce_gradients(self, parameters: list[nn.Parameter]) -> None:
        """Sum this rank's gradients with those of the same rank in the other groups (nothing when semi-sync)."""

    def should_commit(self) -> bool:
        """Whether every group of the quorum got through the step: False discards it (no optimizer step)."""

    def metrics(self) -> dict[str, float]:
        """What the step logs of the groups: participating groups, recoveries, seconds recovering, discarded steps."""
