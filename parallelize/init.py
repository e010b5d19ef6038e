"""Giving a parallelized model (built on meta, then ``to_empty``) its initial values.

Two ways, because CPU and CUDA differ in what DTensor's random ops can do:

- ``init_weights_like_single_device``: every layout gets bit-for-bit the weights a single process gets from
  ``torch.manual_seed(seed); model.init_weights()``. It runs that single-device init on a full host copy and
  copies each rank's shard out of it. Cost: the full model once in host memory per rank, transiently (8 bytes
  per fp32 parameter at peak, e.g. 4 GB per rank for a 1B model), plus every rank doing the whole init's work.
  This is the only exact way on CPU: DTensor's offset-based RNG (the piece that makes a shard draw its own slice
  of the full tensor's random stream) needs a CUDA-like generator; on CPU every rank would draw the same values
  for its different shards. The parity tests rely on it.
- ``init_weights_sharded``: each rank initialises only its own shards. On CUDA, DTensor's offset-based RNG
  gives each shard its own slice of the random stream and keeps replicas identical: correct and scalable to any
  size, but not bit-identical to a single-GPU run (kernel launch shapes decide how the philox stream is split).
  Refused on CPU, where it would give correlated shards.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from dtrain.parallelize.errors import ParallelismError

# Prefixes that wrappers (activation checkpointing, torch.compile wrappers) add to parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def model_fqn(name: str) -> str:
    """A parameter or buffer name without the wrapper prefixes: the model's own FQN."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _local_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` in the layout of `like` (a DTensor or a plain tensor); no communication."""
    full = full.to(device=like.device, dtype=like.dtype)
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
    return full


@torch.no_grad()
def init_weights_like_single_device(
    model: nn.Module, single_device_model: nn.Module, seed: int, buffer_device: torch.device | str | None = None
) -> None:
    """Give `model` (any layout, already ``to_empty``'d) exactly the weights of a seeded single-device init.

    `single_device_model` is an unparallelized copy on the meta device (``copy.deepcopy`` of the meta model
    before parallelize; free). It is materialized on the host, initialised with ``init_weights()`` under
    ``torch.manual_seed(seed)`` (the caller's global RNG state is left as it was), and each parameter and buffer
    of `model` receives its local part. Buffers go to `buffer_device` (default: where each buffer is now).
    """
    reference = copy.deepcopy(single_device_model).to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        reference.init_weights()
    full_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        local.copy_(_local_part(full_params[model_fqn(name)], param))
    full_buffers = dict(reference.named_buffers())
    for name, buffer in list(model.named_buffers()):
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        device = buffer_device if buffer_device is not None else buffer.device
        # Assigned, not copied: a buffer left empty by to_empty may not have its final shape yet.
        setattr(owner, attr, full_buffers[model_fqn(name)].to(device))


@torch.no_grad()
def init_weights_sharded(model: nn.Module, seed: int, buffer_device: torch.device | str | None = None) -> None:
    """Initialise only the local shards with the model's own ``init_weights`` (CUDA-like devices only)."""
    # The mesh's device, not the parameter's: with CPU offload the shards live on the host of a CUDA mesh.
    param = next(model.parameters())
    device_type = param.device_mesh.device_type if isinstance(param, DTensor) else param.device.type
    if device_type == "cpu":
        raise ParallelismError(
            "sharded initialisation needs DTensor's offset RNG, which CPU lacks; use init_weights_like_single_device"
        )
    torch.manual_seed(seed)
    model.init_weights(buffer_device=buffer_device)
