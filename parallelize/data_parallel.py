"""Data parallelism for decoder models: FSDP2 / HSDP (``fully_shard``) or DDP (composable ``replicate``).

A decoder follows the protocol of ``dtrain.models.decoder``: embedding, blocks, final norm, head. FSDP units, in
the order their parameters are used: the embedding, each block, the head (final norm + head together), then the
root. A unit's parameters are gathered for its forward and backward
and sharded otherwise, so peak parameter memory is one unit's full size plus every unit's shard.

Gradients are averaged over the data-parallel ranks (FSDP's and DDP's default); the trainer scales its
sum-over-global-tokens loss by the dp size to turn that average into the global-token mean.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from dtrain.models.decoder import decoder_layout
from dtrain.parallelize.errors import ParallelismError
from dtrain.parallelize.expert_parallel import shard_experts

RESHARD_MODES = ("default", "always", "never")
MIXED_PRECISION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str, key: str) -> torch.dtype:
    """The torch dtype for a config dtype name, or a one-line error naming `key`."""
    if name not in MIXED_PRECISION_DTYPES:
        raise ParallelismError(f"{key}={name!r} is invalid (valid: {', '.join(MIXED_PRECISION_DTYPES)})")
    return MIXED_PRECISION_DTYPES[name]


def _block_reshards(mode: str, is_last: bool) -> bool:
    # The last block's backward starts right after its forward (only the head runs in between), so under
    # "default" it keeps its gathered parameters instead of freeing and re-gathering them at once.
    return {"always": True, "never": False}.get(mode, not is_last)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: str = "default",
    cpu_offload: bool = False,
    experts_mesh: DeviceMesh | None = None,
) -> None:
    """Shard a decoder with FSDP2 over `dp_mesh` (1-D: FSDP; 2-D (replicate, shard): HSDP), in place.

    ``param_dtype`` is the dtype parameters are gathered and computed in; ``reduce_dtype`` the dtype gradients are
    reduced in; the sharded master copy stays in the model's dtype. ``cpu_offload`` keeps sharded parameters,
    gradients and optimizer state in host memory (the optimizer step then runs on the CPU). Under expert parallel,
    the experts of every MoE layer are sharded over ``experts_mesh`` first (expert_parallel.py).
    """
    if reshard_after_forward not in RESHARD_MODES:
        raise ParallelismError(
            f"parallelism.fsdp_reshard_after_forward={reshard_after_forward!r} is invalid "
            f"(valid: {', '.join(RESHARD_MODES)})"
        )
    settings = dict(
        mesh=dp_mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        # Pinned host memory speeds up host<->GPU copies; it needs an accelerator to exist at all.
        offload_policy=CPUOffloadPolicy(pin_memory=dp_mesh.device_type != "cpu") if cpu_offload else OffloadPolicy(),
    )
    decoder = decoder_layout(model)
    embedding, head_module = decoder.part(model, decoder.embedding), decoder.part(model, decoder.head)
    # A tied head shares its weight with the embedding: one parameter can belong to one unit only, so both
    # stay with the root unit.
    tied = embedding is not None and head_module is not None and bool(
        {id(p) for p in embedding.parameters()} & {id(p) for p in head_module.parameters()}
    )
    if embedding is not None and not tied:
        fully_shard(embedding, reshard_after_forward=reshard_after_forward != "never", **settings)
    if experts_mesh is not None:
        expert_settings = dict(settings, mesh=experts_mesh, reshard_after_forward=reshard_after_forward != "never")
        shard_experts(model, **expert_settings)
    blocks = decoder.blocks_of(model)
    names = list(blocks.keys())
    for name in names:
        is_last = name == names[-1]
        fully_shard(blocks[name], reshard_after_forward=_block_reshards(reshard_after_forward, is_last), **settings)
    head = [m for m in (decoder.part(model, decoder.final_norm), head_module) if m is not None]
    if head and not tied:
        fully_shard(head, reshard_after_forward=reshard_after_forward == "always", **settings)
    fully_shard(model, reshard_after_forward=reshard_after_forward == "always", **settings)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Replicate the whole model over `dp_mesh` with DDP's bucketed gradient all-reduce, in place.

    DDP keeps the model's fp32 parameters; the run's compute and reduce dtypes come from mixed_precision.py.
    """
    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)
