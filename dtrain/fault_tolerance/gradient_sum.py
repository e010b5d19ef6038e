"""Gradients summed over the replica groups through torchft's Manager, in flat buckets.

The sum happens after the backward, on the gradients each rank holds, so it is the same for every layout inside a
group (FSDP shards, TP shards, pipeline stages, experts): rank r of every group holds the same pieces. One
all-reduce per bucket of `BUCKET_BYTES` rather than one per parameter, since each collective has a fixed cost
(gloo's especially). It is not overlapped with the backward, which FSDP2's all-reduce hook could do for FSDP
layouts only; one path for every layout was chosen first.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

BUCKET_BYTES = 32 * 2**20


def local_grads(parameters: list[nn.Parameter]) -> list[torch.Tensor]:
    grads = [p.grad for p in parameters if p.grad is not None]
    return [g._local_tensor if isinstance(g, DTensor) else g for g in grads]


def buckets(tensors: list[torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """`tensors` in runs of one dtype and device, each run at most `limit` bytes (or one larger tensor)."""
    by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        by_kind[(t.dtype, t.device)].append(t)
    out = []
    for kind in by_kind.values():
        run, size = [], 0
        for t in kind:
            nbytes = t.numel() * t.element_size()
            if run and size + nbytes > limit:
                out.append(run)
                run, size = [], 0
            run.append(t)
            size += nbytes
        out.append(run)
    return out


def sum_gradients(manager, parameters: list[nn.Parameter]) -> None:
    """Replace each gradient of `parameters` by its sum over the groups of the current quorum. A failed
    collective is recorded by the manager (should_commit then says False) and the gradients are left unusable."""
    pending = []
    for run in buckets(local_grads(parameters)):
        flat = torch.cat([t.reshape(-1) for t in run])
        pending.append((run, flat, manager.allreduce(flat, reduce_op=ReduceOp.SUM)))
    for run, flat, work in pending:
        work.wait()
        for t, piece in zip(run, flat.split([t.numel() for t in run])):
            t.copy_(piece.view_as(t))
