"""Parameter counting that works for any model family, on meta, real or sharded (DTensor) parameters."""

from __future__ import annotations

from torch import nn

from .decoder import decoder_layout


def count_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of parameters in ``model``, a tied weight counted once.

    A sharded (DTensor) parameter counts its global size. ``exclude_embedding`` leaves out the token embedding
    table (the decoder's embedding), except when it is tied to the head: then it is also a matmul weight and
    stays counted.
    """
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a shared tensor only once
    if not exclude_embedding:
        return total
    decoder = decoder_layout(model)
    embedding, head = decoder.part(model, decoder.embedding), decoder.part(model, decoder.head)
    if embedding is not None:
        head_params = {id(p) for p in head.parameters()} if head is not None else set()
        total -= sum(p.numel() for p in embedding.parameters() if id(p) not in head_params)
    return total
