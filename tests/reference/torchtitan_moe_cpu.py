"""torchtitan 0.2.2's mixture-of-experts layer, run on a CPU in float32 through its own code.

Two things stop it there, and each is replaced by the smallest piece that computes the same values:
- its router counts the tokens per expert with `torch.histc` on int64 expert ids, which has a CUDA kernel and no
  CPU one: the counts are taken on the ids as float32 (exact for these small integers) and cast back to int64;
- its experts default to `torch._grouped_mm` in bfloat16 (`MoEArgs.use_grouped_mm`): its own for-loop path
  (`_run_experts_for_loop`) is the float32 computation of the same experts, the one compared at 1e-5.
"""

from __future__ import annotations

import torch

_histc = torch.histc


def _histc_on_cpu(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0, **kwargs) -> torch.Tensor:
    if input.is_floating_point() or input.device.type != "cpu":
        return _histc(input, bins=bins, min=min, max=max, **kwargs)
    return _histc(input.float(), bins=bins, min=min, max=max, **kwargs).to(input.dtype)


def run_moe_in_float32_on_cpu(model_args) -> None:
    """Patch torch.histc for integer input, and take the for-loop experts of `model_args` (if it has experts)."""
    torch.histc = _histc_on_cpu
    moe_args = getattr(model_args, "moe_args", None)
    if moe_args is not None:
        moe_args.use_grouped_mm = False
