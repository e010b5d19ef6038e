"""How torchtitan names and lays out the Qwen3 weights in DCP checkpoints, v0.2 and after.

Names: v0.2.2's are ours; after it, Llama 3's renames (``models/llama3/torchtitan_names.py``), while the QK-norms
keep theirs (``attention.q_norm.weight``, ``attention.k_norm.weight``).

Layout: torchtitan's Qwen3 (v0.2.2's ``models/qwen3/model/model.py``, ``rotate_half``; main likewise) applies RoPE
as Hugging Face does, rotating the two halves of each head where ours rotates interleaved pairs, so its q/k
projection rows and QK-norm weights are in HF's order. They are reordered on the way in exactly as HF's are
(``models/qwen3/hf_adapter.py``). A v0.2 checkpoint thus holds our names in another layout: the names cannot tell
it from ours, and checkpoint.initial_load_writer decides (``dtrain/checkpoint/spellings.py``).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from ..llama3.torchtitan_names import TorchtitanNames, TorchtitanV02Names
from .args import Qwen3Args
from .hf_adapter import Qwen3HFAdapter

# The tensors whose elements follow RoPE's order within a head.
_ROTARY_ORDERED = ("attention.wq.weight", "attention.wk.weight", "attention.q_norm.weight", "attention.k_norm.weight")


class _HFRopeOrder:
    """torchtitan's Qwen3 layout: HF's RoPE order on the q/k side."""

    reorders = True

    def __init__(self, args: Qwen3Args):
        self._hf = Qwen3HFAdapter(args)

    def to_ours(self, fqn: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if not fqn.endswith(_ROTARY_ORDERED):
            return None
        return functools.partial(self._hf.from_hf, fqn)


class Qwen3TorchtitanNames(_HFRopeOrder, TorchtitanNames):
    """Our Qwen3 FQNs as torchtitan >= 0.3 checkpoints spell them, with HF's RoPE order on the q/k side."""


class Qwen3TorchtitanV02Names(_HFRopeOrder, TorchtitanV02Names):
    """Our Qwen3 FQNs as torchtitan v0.2 checkpoints spell them (as we do), with HF's RoPE order on the q/k side."""

    writer = "torchtitan v0.2 (our names, HF's RoPE order in wq, wk and the QK-norms)"


def torchtitan_spellings(args: Qwen3Args) -> tuple[Qwen3TorchtitanNames | Qwen3TorchtitanV02Names, ...]:
    """The spellings besides ours that an initial load accepts for Qwen3 (ModelFamily.checkpoint_spellings)."""
    return (Qwen3TorchtitanNames(args), Qwen3TorchtitanV02Names(args))
