"""Context parallel on CUDA: torch's ring attention over SDPA's flash, memory-efficient and cuDNN kernels.

torch offers it as the ``_ContextParallel`` parallel style (``torch.distributed.tensor.experimental._attention``,
private but the same in torch 2.11 and 2.13, and what torchtitan applies): it marks the tensor inputs of a module
that calls ``F.scaled_dot_product_attention`` as sequence shards (``Shard(2)`` DTensors of ``[b, heads, s, d]``),
and once the CP dispatcher is on, DTensor sends the SDPA kernels and their backwards to ring implementations that
rotate keys and values over the cp group and merge the partial softmaxes by their log-sum-exps. Two process-wide
options of torch steer it: ``enable_load_balance`` (the head-tail layout dtrain's ``headtail`` load balancer
gives, which lets every non-local key block be attended in full or half) and the kv rotation (``allgather``,
``alltoall``).

torch dispatches only the CUDA kernels to ring versions (CPU's flash op has no context-parallel rule), so this is
the CUDA path; context_parallel.py chooses it. The ring ops need one query head per key head: keys and values are
repeated before the ring (``n_heads / n_kv_heads`` times the traffic of dtrain's grouped all-gather).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from dtrain.models.attention import repeat_kv

ROTATE_METHODS = ("allgather", "alltoall")


class _CausalKernel(nn.Module):
    """Causal SDPA of ``[b, heads, s, d]`` tensors: the module torch's style wraps, whose inputs become shards."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def use_torch_ring_attention(kernel: nn.Module, cp_mesh: DeviceMesh, load_balanced: bool, rotate_method: str) -> None:
    """Make `kernel`'s SDPA call torch's ring attention over `cp_mesh` (see the module doc).

    torch's options are per process, not per module: every model of a process gets the last call's settings,
    which are one run's settings in dtrain.
    """
    from torch.distributed.tensor.experimental._attention import (
        _ContextParallel,
        _cp_options,
        _enable_context_parallel_dispatcher,
        set_rotate_method,
    )

    _cp_options.enable_load_balance = load_balanced
    set_rotate_method(rotate_method)
    _enable_context_parallel_dispatcher()
    parallelize_module(
        kernel, cp_mesh, _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
    )


class RingAttention(nn.Module):
    """Causal grouped-query attention of this rank's chunks over the whole sequence through torch's ring.

    The query chunks must be laid out as torch's ring expects: head-tail (rank ``i`` holds chunks ``i`` and
    ``2 cp - 1 - i``) when `load_balancer` is ``headtail``, rank ``i``'s ``1/cp`` otherwise; dtrain's
    ``shard_sequence`` lays them out so, which is why ``positions`` (used by RoPE before this) is not needed here.
    """

    def __init__(self, cp_mesh: DeviceMesh, load_balancer: str, rotate_method: str):
        super().__init__()
        self.kernel = _CausalKernel()
        use_torch_ring_attention(self.kernel, cp_mesh, load_balancer == "headtail", rotate_method)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if document_ids is not None:
            raise ValueError("torch's ring attention is causal only; document masking takes the masked path")
        n_rep = q.shape[2] // k.shape[2]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        return self.kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
