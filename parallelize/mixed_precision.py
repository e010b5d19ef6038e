"""Mixed precision as a property of the run: every layout computes in ``training.mixed_precision_param``.

FSDP2 and HSDP cast the parameters to that dtype as they gather them and reduce gradients in
``training.mixed_precision_reduce`` (``MixedPrecisionPolicy``, data_parallel.py). Every other layout (one
process, DDP, TP, PP without FSDP) keeps its fp32 parameters and runs the model's forward under ``torch.autocast``
in that dtype: matmuls and attention in it, norms, softmax-like ops and the loss in fp32 (autocast's op lists),
gradients and optimizer state in fp32 like the parameters, so the fp32 master weights FSDP keeps exist here too.
Only the forward is wrapped, so backward runs outside autocast (as torch recommends), also when a pipeline
schedule calls it; activation checkpointing replays a block under the autocast state of its forward.

The two are not bit-identical (FSDP's policy computes the norms in the compute dtype too; autocast keeps them in
fp32), so a bf16 layout agrees with the bf16 single process within bf16 rounding, not to fp32 precision.

DDP reduces gradients in the reduce dtype with torch's bf16 compress hook when that is bfloat16; the other
layouts have no data-parallel gradient reduction.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.device_mesh import DeviceMesh


def autocast_forward(model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run `model`'s forward under autocast to `dtype`, in place (nothing to do for float32).

    The wrapped forward is an instance attribute bound to `model`: parallelize is the last thing done to a model,
    so nothing deep-copies it afterwards (a copy would still call the original's forward).
    """
    if dtype == torch.float32:
        return
    model.forward = torch.autocast(device_type, dtype=dtype)(model.forward)


def _all_reduce_in_bf16(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``bf16_compress_hook`` under another name. DDP refuses a hook of that name unless torch was built
    with CUDA and NCCL, though what it does (cast the bucket to bf16, divide by the group size, all-reduce, copy
    back into the fp32 bucket) needs neither: gloo all-reduces bf16 on CPU. (DDP also checks the annotations as
    objects, hence no ``from __future__ import annotations`` in this module.)"""
    return bf16_compress_hook(group, bucket)


def reduce_ddp_gradients_in(model: nn.Module, dp_mesh: DeviceMesh, dtype: torch.dtype) -> None:
    """Make a model under torch's ``replicate`` all-reduce its gradients in `dtype` (float32: as they are)."""
    if dtype == torch.bfloat16:
        model.register_comm_hook(dp_mesh.get_group(), _all_reduce_in_bf16)
