"""Each rank's share of a list of requests, and every rank's answers put back together in the list's order.

The harness hands every rank the same requests (the backend tells it there is one rank: see backend.py); each rank
answers its share and all of them get every answer, so the metrics are the same on every rank and rank 0 writes
them. Shares are dealt round-robin from the requests sorted by length, so every rank gets long and short ones alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.distributed as dist


@dataclass(frozen=True)
class Share:
    """This rank's place among `size` ranks that split the requests (the default process group)."""

    rank: int = 0
    size: int = 1

    @classmethod
    def of_world(cls) -> Share:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def take(self, items: Sequence[Any], length: Callable[[Any], int]) -> list[int]:
        """The indices of this rank's items: every size-th of them, longest first."""
        order = sorted(range(len(items)), key=lambda i: -length(items[i]))
        return order[self.rank::self.size]

    def gather(self, indices: list[int], answers: list[Any], total: int) -> list[Any]:
        """All ranks' answers (this rank's are `answers` to `indices`), one per request in the original order."""
        parts = [(indices, answers)]
        if self.size > 1:
            parts = [None] * self.size
            dist.all_gather_object(parts, (indices, answers))
        merged: list[Any] = [None] * total
        for part_indices, part_answers in parts:
            for index, answer in zip(part_indices, part_answers, strict=True):
                merged[index] = answer
        return merged
