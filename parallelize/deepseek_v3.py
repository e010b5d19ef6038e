"""Parallelizing the DeepSeek-V3 family: a tensor-parallel plan for multi-head latent attention (MLA) and the dense
feed-forward, applied in the shared order (parallelize/decoder_plan.py, ``parallelize_decoder``).

MLA under TP (torchtitan's layout, with plain tensors inside the model): the per-head projections (``wq`` or
``wq_b``, ``wkv_b``) are column-parallel and ``wo`` row-parallel; the per-token ones (``wq_a``/``q_norm``,
``wkv_a``/``kv_norm``) are replicated, with ``ReduceGradient`` on the ``shared_rope_key`` seam summing the rotated
key's gradient over the ranks. The dense feed-forward is the shared decoder's; the MoE blocks' ``moe`` is left to
the generic expert and tensor parallel of every MoE family. Blocks lack some of the plan's modules; the shared
``resolve_plan`` keeps only the paths the model has. Why each placement: docs/models.md, "DeepSeek-V3 under
tensor parallel".
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from dtrain.models.deepseek_v3 import DEEPSEEK_V3, DeepSeekV3Args
from dtrain.parallelize.decoder_plan import decoder_tp_plan, parallelize_decoder
from dtrain.parallelize.family_spec import FamilySpec
from dtrain.parallelize.mesh import ParallelMesh
from dtrain.parallelize.moe_hooks import MOE_STEP_HOOKS
from dtrain.parallelize.options import ParallelizeOptions
from dtrain.parallelize.parallel_dims import ParallelDims
from dtrain.parallelize.tensor_parallel import ReplicateParallel, TPPlan


class ReduceGradient(ParallelStyle):
    """Identity in forward; in backward, the gradient of the module's input is summed over the tp ranks.

    For a tensor that every rank computes whole and then uses for its own heads only (Megatron's "f"): each rank's
    gradient covers its heads, the sum all of them. The input is marked replicated, and its gradient partial.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._sum_gradient_in_backward)

    @staticmethod
    def _sum_gradient_in_backward(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(x, device_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
            if isinstance(x, torch.Tensor)
            else x
            for x in inputs
        )

    def __repr__(self) -> str:
        return "ReduceGradient()"


def deepseek_v3_tp_plan(*, sequence_parallel: bool = True, loss_parallel: bool = True) -> TPPlan:
    """Module path -> ParallelStyle for a DeepSeek-V3 model (see the module doc), for either query form: the shared
    decoder's plan (``decoder_tp_plan``) around MLA's projections. A model has either ``wq`` or ``wq_a``/``q_norm``/
    ``wq_b``, and MoE blocks no ``feed_forward``: parallelize keeps the paths a model has (``resolve_plan``)."""
    projections = {
        "wq": ColwiseParallel(),
        "wq_a": ReplicateParallel(),
        "q_norm": ReplicateParallel(),
        "wq_b": ColwiseParallel(),
        "wkv_a": ReplicateParallel(),
        "kv_norm": ReplicateParallel(),
        "wkv_b": ColwiseParallel(),
        "shared_rope_key": ReduceGradient(),
    }
    return decoder_tp_plan(projections, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def parallelize_deepseek_v3(
    model: nn.Module, mesh: ParallelMesh | None, dims: ParallelDims, options: ParallelizeOptions
) -> nn.Module:
    """Apply TP, activation checkpointing, compile and data parallel to a DeepSeek-V3 model (or stage), in place."""
    return parallelize_decoder(model, mesh, dims, options, deepseek_v3_tp_plan)


def deepseek_v3_tp_sizes(args: DeepSeekV3Args) -> dict[str, int]:
    """What tensor parallel splits: whole heads, the dense FFN's hidden units (if any block is dense), vocabulary
    rows. MLA's latents are replicated, so their ranks need not divide."""
    sizes = {"model.n_heads": args.n_heads, "the model's vocab size": args.vocab_size}
    if args.n_dense_layers:
        sizes["the model's FFN hidden size"] = args.hidden_dim
    return sizes


DEEPSEEK_V3_SPEC = FamilySpec(
    model=DEEPSEEK_V3,
    parallelize=parallelize_deepseek_v3,
    tp_plan=deepseek_v3_tp_plan,
    tp_sizes=deepseek_v3_tp_sizes,
    # The auxiliary loss where a flavor has one (16B), the loss-free balancing bias where it has that (671B).
    **MOE_STEP_HOOKS,
)
