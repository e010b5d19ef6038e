"""How torchtitan after v0.2.2 names and lays out the Qwen3 weights in DCP checkpoints.

Names: Llama 3's renames (``models/llama3/torchtitan_names.py``); the QK-norms keep theirs
(``attention.q_norm.weight``, ``attention.k_norm.weight``).

Layout: torchtitan's Qwen3 (v0.2.2 and main) applies RoPE as Hugging Face does, rotating the two halves of each
head where ours rotates interleaved pairs, so its q/k projection rows and QK-norm weights are in HF's order.
They are reordered on the way in exactly as HF's are (``models/qwen3/hf_adapter.py``).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from ..llama3.torchtitan_names import TorchtitanNames
from .args import Qwen3Args
from .hf_adapter import Qwen3HFAdapter

# The tensors whose elements follow RoPE's order within a head.
_ROTARY_ORDERED = ("attention.wq.weight", "attention.wk.weight", "attention.q_norm.weight", "attention.k_norm.weight")


class Qwen3TorchtitanNames(TorchtitanNames):
    """Our Qwen3 FQNs as torchtitan >= 0.3 checkpoints spell them, with HF's RoPE order on the q/k side."""

    def __init__(self, args: Qwen3Args):
        self._hf = Qwen3HFAdapter(args)

    def to_ours(self, fqn: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if not fqn.endswith(_ROTARY_ORDERED):
            return None
        return functools.partial(self._hf.from_hf, fqn)


def torchtitan_spellings(args: Qwen3Args) -> tuple[Qwen3TorchtitanNames, ...]:
    """The spellings besides ours that an initial load accepts for Qwen3 (ModelFamily.checkpoint_spellings)."""
    return (Qwen3TorchtitanNames(args),)
