"""Activation checkpointing of transformer blocks: none, full, every Nth block, selective by op, or a memory budget.

Blocks are wrapped with torch's ``checkpoint_wrapper`` (non-reentrant). The wrapper inserts
``_checkpoint_wrapped_module`` into parameter names; state dicts (``module.state_dict`` and DCP's
``get_state_dict``) strip it again, so checkpoints keep the model's own FQNs.

``memory_budget`` wraps nothing: torch.compile's min-cut partitioner, which splits each compiled block's joint
graph into forward and backward, chooses what to keep for backward so that the kept activations are at most
``memory_budget`` of the way from full recomputation (0) to keeping what its speed-optimal partition keeps (1),
recomputing the cheapest ops first (torch._functorch.config.activation_memory_budget, a process-wide setting).
Only the backends that partition with min-cut honour it: inductor and aot_eager_decomp_partition.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

from dtrain.parallelize.errors import ParallelismError

AC_MODES = ("none", "full", "selective", "memory_budget")
# The torch.compile backends whose joint-graph partitioner (min-cut) reads the activation memory budget.
MEMORY_BUDGET_BACKENDS = ("inductor", "aot_eager_decomp_partition")

_aten = torch.ops.aten

# Ops whose outputs selective-by-op AC keeps, so backward recomputes only the cheap elementwise work between them.
# The matmuls are the expensive part; attention is named once per backend because each device runs its own SDPA
# op (a save list with only the CUDA kernels would silently recompute attention on CPU). Reduce-scatter and
# all-to-all outputs are kept so that recomputation never repeats TP or expert-parallel communication; the
# experts' grouped matmuls are matmuls too.
SAC_SAVE_OPS = frozenset(
    {
        _aten.mm.default,
        _aten._grouped_mm.default,
        torch.ops._c10d_functional.all_to_all_single.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }
)


def parse_selective_option(mode: str, option: str) -> int | None:
    """Validate the AC settings; for selective AC, return N of "every Nth block", or None for "op"."""
    if mode not in AC_MODES:
        raise ParallelismError(f"activation_checkpoint.mode={mode!r} is invalid (valid: {', '.join(AC_MODES)})")
    if mode != "selective" or option == "op":
        return None
    if not option.isdigit() or int(option) < 1:
        raise ParallelismError(
            f"activation_checkpoint.selective_ac_option={option!r} is invalid (valid: op, or a positive integer N "
            f"to checkpoint every Nth block)"
        )
    return int(option)


def check_memory_budget(mode: str, budget: float, compile_model: bool, compile_backend: str) -> None:
    """Refuse a memory budget that nothing would honour: out of range, without compile, or on another backend."""
    if mode != "memory_budget":
        return
    if not 0.0 <= budget <= 1.0:
        raise ParallelismError(f"activation_checkpoint.memory_budget={budget} is invalid (valid: 0.0 to 1.0)")
    if not compile_model:
        raise ParallelismError(
            "activation_checkpoint.mode='memory_budget' is applied by torch.compile's partitioner and needs "
            "compile.enable = true with 'model' in compile.components"
        )
    if compile_backend not in MEMORY_BUDGET_BACKENDS:
        raise ParallelismError(
            f"activation_checkpoint.mode='memory_budget' is ignored by compile.backend={compile_backend!r} "
            f"(valid: {', '.join(MEMORY_BUDGET_BACKENDS)})"
        )


def set_memory_budget(budget: float) -> None:
    """The fraction of a compiled block's activations the partitioner may keep (see the module doc)."""
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = budget


# Profiler annotations (``record_function``), which op-level AC must not count. torch 2.13's selective
# checkpointing replays a block's recomputation by counting each op's calls, annotations included (2.11 does not
# count them). Under expert parallel the experts are an FSDP unit inside the block, whose hooks annotate their work
# a different number of times in the forward and in the recomputation; the replay then fails with
# "profiler._record_function_enter_new invocation index 3 ... not found in storage". Annotations compute nothing,
# so leaving them out of the count is exact; torch's own fix does the same (pytorch/pytorch#196862).
# SAC_IGNORED_OPS is torch's public set of such ops.
PROFILER_ANNOTATION_OPS = (
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
)


def _save_listed_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAC_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_op_context():
    # A fresh pair of contexts for every checkpointed call, as torch.utils.checkpoint requires.
    return create_selective_checkpoint_contexts(_save_listed_ops)


def apply_ac(blocks: nn.ModuleDict, mode: str, selective_option: str = "2") -> None:
    """Wrap blocks in place: all of them (full, or selective by op), or every Nth one (selective with N).

    "Every Nth" counts from 1, as torchtitan does: with N=2 blocks 1, 3, 5, ... (0-based) are checkpointed.
    """
    every_nth = parse_selective_option(mode, selective_option)
    if mode in ("none", "memory_budget"):
        return
    if mode == "selective" and every_nth is None:
        SAC_IGNORED_OPS.update(PROFILER_ANNOTATION_OPS)
    for position, (name, block) in enumerate(list(blocks.items()), start=1):
        if mode == "full":
            wrapped = checkpoint_wrapper(block)
        elif every_nth is None:
            wrapped = checkpoint_wrapper(block, context_fn=_selective_op_context)
        elif position % every_nth == 0:
            wrapped = checkpoint_wrapper(block)
        else:
            continue
        blocks[name] = wrapped
