"""Initial loads of DCP checkpoints that spell a family's weights otherwise, e.g. as a newer torchtitan does.

The family lists what it accepts (``ModelFamily.checkpoint_spellings``); the first spelling whose names the
checkpoint holds is used. A weight stored as ours loads straight into this rank's shards, as under our own names.
One that must be reordered is read whole, converted, and cut into this rank's shards; whole tensors are read a few
at a time, so a rank holds at most about WHOLE_TENSOR_BUDGET bytes of them beyond its shards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dtrain.models.family import WeightSpelling
from dtrain.parallelize import get_family

WHOLE_TENSOR_BUDGET = 1 << 30


def family_spellings(family: str, model_args: Any) -> tuple[WeightSpelling, ...]:
    """The other spellings the family registered as `family` accepts, for models of `model_args`."""
    return get_family(family).model.checkpoint_spellings(model_args)


def find_spelling(
    shapes: dict[str, tuple[int, ...]],
    prefix: str,
    weights: dict[str, torch.Tensor],
    spellings: tuple[WeightSpelling, ...],
) -> WeightSpelling | None:
    """The first of `spellings` under which the checkpoint holds every weight; None when it holds ours, or when no
    spelling fits (the caller then reports the weights missing under ours)."""
    if all(prefix + fqn in shapes for fqn in weights):
        return None
    return next((s for s in spellings if all(prefix + s.stored_name(fqn) in shapes for fqn in weights)), None)


def whole_tensor_batches(
    fqns: list[str], weights: dict[str, torch.Tensor], group: dist.ProcessGroup | None,
    budget: int = WHOLE_TENSOR_BUDGET,
) -> list[list[str]]:
    """`fqns` in batches of at most `budget` bytes of whole tensors (one tensor at least), padded with empty
    batches to the same count on every rank: each batch is one collective DCP load, and pipeline stages hold
    different weights."""
    batches: list[list[str]] = []
    size = 0
    for fqn in fqns:
        nbytes = weights[fqn].numel() * weights[fqn].element_size()  # a DTensor's numel is the whole tensor's
        if not batches or size + nbytes > budget:
            batches.append([])
            size = 0
        batches[-1].append(fqn)
        size += nbytes
    if group is not None:
        count = torch.tensor([len(batches)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        batches += [[] for _ in range(int(count) - len(batches))]
    return batches
