"""Activation checkpointing of transformer blocks: none, full, every Nth block, or selective by op.

Blocks are wrapped with torch's ``checkpoint_wrapper`` (non-reentrant). The wrapper inserts
``_checkpoint_wrapped_module`` into parameter names; state dicts (``module.state_dict`` and DCP's
``get_state_dict``) strip it again, so checkpoints keep the model's own FQNs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from dtrain.parallelize.errors import ParallelismError

AC_MODES = ("none", "full", "selective")

_aten = torch.ops.aten

# Ops whose outputs selective-by-op AC keeps, so backward recomputes only the cheap elementwise work between them.
# The matmuls are the expensive part; attention is named once per backend because each device runs its own SDPA
# op (a save list with only the CUDA kernels would silently recompute attention on CPU). Reduce-scatter outputs
# are kept so that recomputation never repeats TP communication.
SAC_SAVE_OPS = frozenset(
    {
        _aten.mm.default,
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
    if mode == "none":
        return
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
