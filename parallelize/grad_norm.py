"""The gradient norm of a model whose gradients live on several meshes.

torch's ``get_total_norm`` takes each gradient's norm and stacks them, which DTensor allows only on one mesh.
Under expert parallel the experts' gradients live on the ``(efsdp, ep)`` mesh and the others on FSDP's, so the
norm is taken per mesh (one reduction each) and the squares summed; with one mesh this is torch's call as is.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of `grads`: a DTensor when they share one mesh, else a plain tensor equal on every rank."""
    by_mesh: dict = {}
    for grad in grads:
        by_mesh.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    if len(by_mesh) <= 1:
        return torch.nn.utils.get_total_norm(grads, foreach=True)
    norms = [torch.nn.utils.get_total_norm(group, foreach=True) for group in by_mesh.values()]
    squares = [(norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2 for norm in norms]
    return torch.stack(squares).sum().sqrt()
