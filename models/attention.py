"""The inner attention: the seam between a family's attention projections and the attention kernel.

A family's attention module projects and rotates queries and keys, then calls its ``inner_attention`` submodule
with ``q [batch, seq, heads, head_dim]``, ``k``/``v [batch, seq, kv_heads, head_dim]`` (grouped-query: fewer kv
heads, not yet repeated) and the ``positions [seq]`` of those tokens in their sequence. What attends to what is
decided here, so that context parallel (keys and values of other ranks' sequence chunks), document masking or
another kernel replace this module from a plan, without touching the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Repeat each key/value head ``n_rep`` times: ``[b, s, kv_heads, d] -> [b, s, kv_heads * n_rep, d]``.

    Query head ``h`` then lines up with kv head ``h // n_rep``, the grouping GQA checkpoints were trained with.
    """
    if n_rep == 1:
        return x
    bsz, seqlen, n_kv_heads, head_dim = x.shape
    return x[:, :, :, None, :].expand(bsz, seqlen, n_kv_heads, n_rep, head_dim).reshape(
        bsz, seqlen, n_kv_heads * n_rep, head_dim
    )


class CausalSDPA(nn.Module):
    """Causal grouped-query attention over one whole sequence, through ``scaled_dot_product_attention``.

    The queries and keys are the same tokens in order, so causality is "earlier in the tensor" and ``positions``
    is not needed; implementations that see only part of a sequence (context parallel) use it.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n_rep = q.shape[2] // k.shape[2]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        # SDPA wants [batch, heads, seq, head_dim]; is_causal lets it pick flash/efficient kernels where present.
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)
