"""Parameter counting that works for any model family, on meta, real or sharded (DTensor) parameters."""

from __future__ import annotations

from torch import nn


def count_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of parameters in ``model``, a tied weight counted once.

    A sharded (DTensor) parameter counts its global size. ``exclude_embedding`` leaves out the token embedding
    table (``model.tok_embeddings``), except when it is tied to the output head: then it is also a matmul
    weight and stays counted.
    """
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a shared tensor only once
    embedding = getattr(model, "tok_embeddings", None)
    if exclude_embedding and embedding is not None:
        head = getattr(model, "output", None)
        if head is None or head.weight is not embedding.weight:
            total -= embedding.weight.numel()
    return total
