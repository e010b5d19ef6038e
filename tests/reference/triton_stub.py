"""torchtitan 0.2.2's MoE code, importable on a machine without triton.

`torchtitan/models/moe/kernels.py` imports triton at module level for a GPU kernel that permutes tokens under
expert parallel; one process on a CPU never calls it. The CPU build of torch ships no triton, and a stand-in
`triton` module would mislead torch itself (dynamo and inductor probe for it), so the reference scripts replace
that one torchtitan module instead, with a function that says so if it is ever called.
"""

from __future__ import annotations

import importlib.util
import sys
import types

KERNELS = "torchtitan.models.moe.kernels"


def install_triton_stub() -> None:
    """Stand in for torchtitan's triton kernels module unless triton is importable (torch 2.11's CUDA build)."""
    if importlib.util.find_spec("triton") is not None:
        return

    def generate_permute_indices(*args, **kwargs):
        raise RuntimeError("torchtitan's token permutation kernel needs triton (expert parallel on a GPU)")

    kernels = types.ModuleType(KERNELS)
    kernels.generate_permute_indices = generate_permute_indices
    sys.modules[KERNELS] = kernels
