"""Which replica groups are in each quorum, by their dtrain replica_id: a repeated id refused, a group lost or back
said in one line.

torchft makes every group's name unique by a suffix, so two launches with one replica_id would both train on the
same share of the data. After every quorum each group adds a one at its id (an all-reduce over the quorum of
group_size numbers): a count above one is a repeated id. Only a launch at its first quorum is refused; a group
already training with that id goes on (its peers keep their run), and the newcomer's exit discards the step in
flight, which is retried without it.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed import ReduceOp

from dtrain.errors import DtrainError

logger = logging.getLogger("dtrain")


class ReplicaError(DtrainError):
    """The replica groups cannot work together as configured (a lighthouse that does not answer, two groups
    under one replica id)."""


class QuorumLost(ReplicaError):
    """The groups' quorum did not come within its timeout: without the lighthouse no group can go on."""


class QuorumMembers:
    def __init__(self, replica_id: int, group_size: int, device: torch.device) -> None:
        self.replica_id, self.group_size, self.device = replica_id, group_size, device
        self.present: set[int] | None = None  # the ids of the last quorum (None before the first)
        self.repeats_said: set[int] = set()

    def check(self, manager) -> None:
        """After a quorum: refuse this launch if its id is taken, say which groups left or came back."""
        counts = torch.zeros(self.group_size, dtype=torch.float32, device=self.device)
        counts[self.replica_id] = 1
        manager.allreduce(counts, reduce_op=ReduceOp.SUM).wait()
        if manager.errored() is not None:  # a group failed in this very all-reduce: the step is discarded anyway
            return
        step = manager.current_step() + 1
        counts = [int(n) for n in counts.tolist()]
        repeated = [i for i, n in enumerate(counts) if n > 1]
        if repeated and self.present is None:
            raise ReplicaError(
                f"fault_tolerance.replica_id {repeated[0]} is used by {counts[repeated[0]]} replica groups at once; "
                f"give each group its own id in [0, fault_tolerance.group_size = {self.group_size})"
            )
        for i in set(repeated) - self.repeats_said:
            logger.warning("replica group %d: a second launch with replica_id %d joined at step %d and is refused; "
                           "this group goes on", self.replica_id, i, step)
        self.repeats_said = set(repeated)
        present = {i for i, n in enumerate(counts) if n > 0}
        if self.present is not None:
            for i in sorted(self.present - present):
                logger.warning("replica group %d: group %d lost at step %d; %d of %d groups train on",
                               self.replica_id, i, step, len(present), self.group_size)
            for i in sorted(present - self.present):
                logger.info("replica group %d: group %d joined at step %d; %d of %d groups train",
                            self.replica_id, i, step, len(present), self.group_size)
        self.present = present
