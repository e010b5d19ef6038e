"""The Qwen3 transformer: the shared pre-norm decoder (models/transformer.py) with QK-norm; with experts in the
args (``Qwen3Args.moe``), every block's feed-forward is a routed mixture of experts (Qwen3-MoE)."""

from __future__ import annotations

from typing import ClassVar

from ..transformer import Transformer


class Qwen3Transformer(Transformer):
    """Qwen3: Llama's decoder whose attention RMS-normalises queries and keys per head before RoPE."""

    qk_norm: ClassVar[bool] = True
