"""A key/value cache for generation, put in at the inner-attention seam, so no family's model changes for it.

Decoding one token at a time needs the keys and values of every earlier token. ``kv_cache(model, max_len)``
swaps each attention's ``inner_attention`` (``dtrain.models.attention``) for a ``CachedAttention`` that appends the
new tokens' keys and values to its buffers and attends the new queries over everything cached so far; on leaving
the ``with`` block the original modules come back. The caller feeds tokens in order with their ``positions``
(the prompt at ``0 .. P-1``, then one token at ``P``, ``P+1``, ...), which RoPE reads; the cache itself tracks how
many tokens it holds, so that no step has to read positions back from the device.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .attention import repeat_kv


class CachedAttention(nn.Module):
    """Causal grouped-query attention of new tokens over the cached tokens and themselves.

    The buffers ``[batch, max_len, kv_heads, head_dim]`` are allocated on the first call, from the shapes and
    device it sees; keys and values are kept before GQA repetition (``kv_heads``, not ``heads``), so the cache is
    ``heads / kv_heads`` times smaller than the attention it serves.
    """

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if document_ids is not None:
            # A prompt is one document: generation attends causally over everything it has seen.
            raise ValueError("generation is causal over the whole context; call the model without document_ids")
        bsz, seqlen, n_kv_heads, head_dim = k.shape
        start, end = self.length, self.length + seqlen
        if end > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} tokens; {end} were fed")
        if self.keys is None:
            self.keys = k.new_empty(bsz, self.max_len, n_kv_heads, head_dim)
            self.values = v.new_empty(bsz, self.max_len, n_kv_heads, head_dim)
        self.keys[:, start:end] = k
        self.values[:, start:end] = v
        self.length = end
        n_rep = q.shape[2] // n_kv_heads
        keys = repeat_kv(self.keys[:, :end], n_rep).transpose(1, 2)
        values = repeat_kv(self.values[:, :end], n_rep).transpose(1, 2)
        # New token i (at position start + i) sees every cached token and the new ones up to itself. One new
        # token sees everything, so it needs no mask.
        mask = None
        if seqlen > 1:
            mask = torch.ones(seqlen, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
        return out.transpose(1, 2)


@contextlib.contextmanager
def kv_cache(model: nn.Module, max_len: int) -> Iterator[list[CachedAttention]]:
    """Give every attention of ``model`` a KV cache of ``max_len`` tokens for the duration of the block.

    Yields the caches (one per attention, in module order). Feeding the same tokens twice would cache them twice:
    use a fresh block per sequence.
    """
    owners = [module for module in model.modules() if isinstance(getattr(module, "inner_attention", None), nn.Module)]
    if not owners:
        raise TypeError(f"{type(model).__name__} has no inner_attention to cache (see dtrain.models.attention)")
    originals = [owner.inner_attention for owner in owners]
    caches = [CachedAttention(max_len) for _ in owners]
    for owner, cache in zip(owners, caches):
        owner.inner_attention = cache
    try:
        yield caches
    finally:
        for owner, original in zip(owners, originals):
            owner.inner_attention = original
