"""Per-rank memory held by the model's parameters, their gradients and the optimizer state.

Counts local shards only (what this rank actually stores), so FSDP over N ranks shows about 1/N of the single
process numbers; that is the evidence the trainer logs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank stores (its local shard for a DTensor; also on the meta device)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes `tensor` (a DTensor: its local shard) holds: a tensor subclass's inner tensors (torchao's NF4
    codes and scales), not the size of the tensor it stands for."""
    local = local_shard(tensor)
    if is_traceable_wrapper_subclass(local):
        names, _ = local.__tensor_flatten__()
        return sum(stored_bytes(getattr(local, name)) for name in names)
    return local.numel() * local.element_size()


def _local_bytes(tensors) -> int:
    return sum(stored_bytes(tensor) for tensor in tensors if tensor is not None)


@dataclass(frozen=True)
class MemoryFootprint:
    """Bytes this rank holds for parameters, gradients (once computed) and optimizer state."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    def __add__(self, other: MemoryFootprint) -> MemoryFootprint:
        """Footprints of several model parts (pipeline stages on one rank) add up."""
        return MemoryFootprint(
            self.param_bytes + other.param_bytes,
            self.grad_bytes + other.grad_bytes,
            self.optimizer_bytes + other.optimizer_bytes,
        )

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def format(self) -> str:
        mib = 1024**2
        return (
            f"params {self.param_bytes / mib:.2f} MiB, grads {self.grad_bytes / mib:.2f} MiB, "
            f"optimizer {self.optimizer_bytes / mib:.2f} MiB (this rank)"
        )


def memory_footprint(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryFootprint:
    """Local bytes of `model`'s parameters, of their gradients and of `optimizer`'s state tensors.

    Gradients are counted as one local-shard-sized tensor per trainable parameter, what backward leaves before
    the step frees them, so the figure does not depend on when it is taken. Optimizer state is what exists now
    (Adam creates its moments at the first step).
    """
    params = list(model.parameters())  # a tied weight is listed once
    state_tensors = []
    if optimizer is not None:
        for state in optimizer.state.values():
            state_tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return MemoryFootprint(
        param_bytes=_local_bytes(params),
        grad_bytes=_local_bytes([p for p in params if p.requires_grad]),
        optimizer_bytes=_local_bytes(state_tensors),
    )
