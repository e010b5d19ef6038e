"""Initial loads of DCP checkpoints that spell a family's weights otherwise, e.g. as a newer torchtitan does.

Only a checkpoint without dtrain's commit record (one from elsewhere) may spell them otherwise. The family lists
what it accepts (``ModelFamily.checkpoint_spellings``), and checkpoint.initial_load_writer narrows it to one
project's; of the rest, the first spelling whose names the checkpoint holds is used. Names that are ours mean our
layout, unless a spelling under the same names stores some tensor in another order (torchtitan v0.2's Qwen3): then
the names cannot tell, and the load is refused until initial_load_writer says who wrote the checkpoint.
A weight stored as ours loads straight into this rank's shards, as under our own names.
One that must be reordered is read whole, converted, and cut into this rank's shards; whole tensors are read a few
at a time, so a rank holds at most about WHOLE_TENSOR_BUDGET bytes of them beyond its shards.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from dtrain.checkpoint.folders import COMMIT_FILE
from dtrain.errors import DtrainError
from dtrain.models.decoder import DecoderArgs
from dtrain.models.family import WeightSpelling
from dtrain.parallelize import get_family

WHOLE_TENSOR_BUDGET = 1 << 30


def family_spellings(family: str, model_args: DecoderArgs) -> tuple[WeightSpelling, ...]:
    """The other spellings the family registered as `family` accepts, for models of `model_args`."""
    return get_family(family).model.checkpoint_spellings(model_args)


def model_fqns(weights: dict[str, torch.Tensor], group: dist.ProcessGroup | None) -> list[str]:
    """The FQNs of the whole model, gathered from every rank: pipeline stages hold different weights, and every
    rank must choose the same spelling (a stage of embeddings alone could not tell the Qwen3 layouts apart)."""
    if group is None:
        return sorted(weights)
    gathered: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, sorted(weights), group=group)
    return sorted({fqn for names in gathered for fqn in names})


def find_spelling(
    shapes: dict[str, tuple[int, ...]],
    prefix: str,
    fqns: list[str],
    spellings: tuple[WeightSpelling, ...],
    writer: str = "auto",
    path: Path | None = None,
) -> WeightSpelling | None:
    """The spelling under which the checkpoint at `path` holds every weight of `fqns` (the whole model's); None
    for ours, and where nothing fits (the caller then reports the weights missing under ours). `writer` is
    checkpoint.initial_load_writer."""
    if writer == "dtrain":
        return None
    fitting = [
        s for s in spellings
        if writer in ("auto", s.project) and all(prefix + s.stored_name(fqn) in shapes for fqn in fqns)
    ]
    if writer != "auto" or not all(prefix + fqn in shapes for fqn in fqns):
        return next(iter(fitting), None)
    rival = next((s for s in fitting if s.reorders), None)
    if rival is not None:
        raise DtrainError(
            f"checkpoint {path} has no {COMMIT_FILE}, and its names fit both dtrain's layout and {rival.writer}: "
            f"set checkpoint.initial_load_writer to dtrain or {rival.project}, whichever wrote it"
        )
    return None


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
