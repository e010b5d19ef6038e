"""The Qwen3 (dense) transformer: the shared pre-norm decoder (models/transformer.py) with QK-norm."""

from __future__ import annotations

from typing import ClassVar

from ..transformer import Transformer


class Qwen3Transformer(Transformer):
    """Qwen3: Llama's decoder whose attention RMS-normalises queries and keys per head before RoPE."""

    qk_norm: ClassVar[bool] = True
