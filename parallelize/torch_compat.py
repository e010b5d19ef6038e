"""Where torch versions differ in what dtrain relies on: every version-dependent piece lives here.

dtrain supports torch 2.11 (what the lent GPU machines have) and 2.13 (the CPU default); CI runs the whole suite
on both. Each piece below names the versions it is for, so it can go when the oldest supported torch no longer
needs it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.torch_version import TorchVersion

# torch 2.11's DefaultStager (async DCP saves) closes its inner copier after every staging, which empties the
# copier's type table: a second save through the same stager fails with "KeyError: <class 'type'>". torch 2.13
# keeps the stager usable, with its host buffers cached from one save to the next. (Not checked on 2.12, which
# is treated like 2.11: a fresh stager per save is correct everywhere, only without the buffer reuse.)
ASYNC_STAGER_IS_REUSABLE = TorchVersion(torch.__version__) >= (2, 13)

# The weight-gradient pass of the split-backward pipeline schedules (zero-bubble, V) re-enters autograd at the
# stage's intermediate nodes. torch 2.11 reads ``node._input_metadata`` there, which custom autograd.Function
# nodes refuse ("Attribute '_input_metadata' is invalid"), so a stage with torchao's float8 linears (a custom
# Function per matmul) fails in its first W action; torch 2.13 runs it (2.12 unchecked, treated like 2.11).
SPLIT_BACKWARD_RUNS_CUSTOM_FUNCTIONS = TorchVersion(torch.__version__) >= (2, 13)

# torchao's MXFP8 training (0.18) asserts DTensor rules that torch 2.11 lacks (``scaled_mm_single_dim_strategy``,
# ``is_pinned_handler``: "Please install the latest torch nightly build"); torch 2.13 has them (2.12 unchecked).
MXFP8_TRAINING_SUPPORTED = TorchVersion(torch.__version__) >= (2, 13)

# The autograd-aware all-gather of functional collectives (backward: reduce-scatter): torch 2.13 names it
# all_gather_single_autograd and deprecates all_gather_tensor_autograd, the only name torch 2.11 has.
all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


class PipelineStageWithoutSelfP2P(PipelineStage):
    """A PipelineStage that never sends to itself while warming up its neighbours' connections.

    torch 2.11's multi-stage schedules open every pipeline by one batch of dummy sends and receives to each
    stage's previous and next stage. Under a V placement (ZBVZeroBubble, DualPipeV) two neighbouring stages
    share a rank, so that batch holds sends to this very rank, which gloo cannot do ("Pair is not connected
    ... <--> [none]"); the schedule itself then hands activations between those stages in memory. Dropping the
    self-addressed dummies is therefore exact. torch 2.13 replaced the warm-up with a vote protocol and no
    longer calls this method for a PipelineStage, so there the override is inert.
    """

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]


class PipelineStageWithForwardOnlyHandoff(PipelineStageWithoutSelfP2P):
    """A PipelineStage that a V schedule's ``eval`` (forward only) can run.

    A V placement (ZBVZeroBubble, DualPipeV) hands input gradients between the two neighbouring stages of rank 0 in
    memory, and ``Schedule.eval`` still walks the backward actions of the schedule (they do nothing when the stage
    has no backward), but that handoff asserts that the stage has a backward: "can't steal_bwd_input if this stage
    doesn't have backward" (torch 2.11 and 2.13). Without a backward there is no gradient to hand over, so the
    handoff is skipped then; with one, it is torch's.
    """

    def get_local_bwd_output(self, mb_index: int):
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


def _is_partial(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor) and any(placement.is_partial() for placement in tensor.placements)


def clip_grads_with_norm_(parameters: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """``torch.nn.utils.clip_grads_with_norm_`` (foreach), made to scale Partial DTensor gradients too.

    torch 2.11's ``_foreach_mul_`` leaves a Partial DTensor unchanged, silently; 2.13 scales it. Under sequence
    parallel the norm weights' gradients are ``Partial(sum)`` (each TP rank holds its sequence shard's share),
    so on 2.11 they escaped clipping and TP+SP runs drifted from one process by 1e-4 within ten steps. A
    per-tensor ``mul_`` is right on both versions, so the few Partial gradients take that path and every other
    gradient keeps the foreach kernel.
    """
    partial = [p for p in parameters if p.grad is not None and _is_partial(p.grad)]
    others = [p for p in parameters if p.grad is not None and not _is_partial(p.grad)]
    # One foreach kernel per mesh: a foreach op over DTensors takes one mesh (expert parallel's experts have theirs).
    by_mesh: dict = {}
    for p in others:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm, foreach=True)
    if partial:
        torch.nn.utils.clip_grads_with_norm_(partial, max_norm, total_norm, foreach=False)
