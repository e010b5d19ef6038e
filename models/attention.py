"""The inner attention: the seam between a family's attention projections and the attention kernel.

A family's attention module projects and rotates queries and keys, then calls its ``inner_attention`` submodule
with ``q [batch, seq, heads, head_dim]``, ``k``/``v [batch, seq, kv_heads, head_dim]`` (grouped-query: fewer kv
heads, not yet repeated), the ``positions [seq]`` of those tokens in their sequence and ``document_ids [batch,
seq]`` (or None), all positionally. What attends to what is decided here, so that context parallel (keys and
values of other ranks' sequence chunks) or another kernel replace this module from a plan, without touching the
model.

Document masking (``training.attention_mask = "block_causal"``): packed windows hold several documents, and
``document_ids`` numbers the document each token belongs to. A token then attends only to earlier tokens of its
own document; None means plain causal attention over the whole window.
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
    """Causal grouped-query attention over one whole sequence, through ``scaled_dot_product_attention``; with
    ``document_ids``, causal within each document only.

    The queries and keys are the same tokens in order, so without documents causality is "earlier in the tensor"
    and ``positions`` is not needed; implementations that see only part of a sequence (context parallel) use it.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        n_rep = q.shape[2] // k.shape[2]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        # SDPA wants [batch, heads, seq, head_dim]; is_causal lets it pick flash/efficient kernels where present.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if document_ids is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(positions, document_ids))
        return out.transpose(1, 2)


def document_causal_mask(positions: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, seq, seq]`` True where query i may attend to key j: j is not after i and in i's document.

    SDPA turns it into an additive mask in the compute dtype and keeps that for backward: ``seq²`` elements per
    sequence and layer (see ``dtrain.run.memory_preflight``).
    """
    causal = positions[:, None] >= positions[None, :]
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    return (causal & same_document)[:, None]
