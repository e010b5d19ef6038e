"""How torchtitan names the Llama 3 weights in DCP checkpoints: v0.2 as we do, its main branch (the coming 0.3)
otherwise.

v0.2.2's names and layout are ours (read in its ``models/llama3/model/model.py``). Read at torchtitan main b5bcd76
(2026-08-21; no release after v0.2.2 yet), two renames:
- the q/k/v projections moved into a ``qkv_linear`` module (#2878): ``layers.N.attention.qkv_linear.wq.weight``,
  ``...wk.weight``, ``...wv.weight``. Models that fuse them into one ``wqkv`` in memory (the default since #3714)
  split it back into these three whenever they save (#3656), so checkpoints hold them separately;
- the head is ``lm_head`` (#2937); a tied model stores the shared weight under ``tok_embeddings.weight`` and
  ``lm_head.weight`` both, as ours does under ``output.weight``.
Every other name (``tok_embeddings``, ``attention.wo``, ``feed_forward.w1/w2/w3``, ``attention_norm``,
``ffn_norm``, ``norm``) is unchanged, and so is every layout: both projects rotate interleaved pairs in RoPE.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

_TOP_LEVEL = {"output.weight": "lm_head.weight"}
_IN_BLOCK = {f"attention.{w}.weight": f"attention.qkv_linear.{w}.weight" for w in ("wq", "wk", "wv")}
_BLOCK_FQN = re.compile(r"^(layers\.\d+\.)(.+)$")


class TorchtitanNames:
    """Our Llama 3 FQNs as torchtitan >= 0.3 checkpoints spell them; the stored tensors are ours as they are."""

    writer = "torchtitan >= 0.3 (attention.qkv_linear.wq/wk/wv, lm_head)"
    project = "torchtitan"
    reorders = False

    def stored_name(self, fqn: str) -> str:
        if fqn in _TOP_LEVEL:
            return _TOP_LEVEL[fqn]
        match = _BLOCK_FQN.match(fqn)
        if match and match.group(2) in _IN_BLOCK:
            return match.group(1) + _IN_BLOCK[match.group(2)]
        return fqn

    def to_ours(self, fqn: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return None


class TorchtitanV02Names:
    """Our Llama 3 FQNs and tensors as torchtitan v0.2 stores them: the same. Listed so that
    checkpoint.initial_load_writer = torchtitan accepts its checkpoints."""

    writer = "torchtitan v0.2 (our names and layout)"
    project = "torchtitan"
    reorders = False

    def stored_name(self, fqn: str) -> str:
        return fqn

    def to_ours(self, fqn: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return None


def torchtitan_spellings(args: Any) -> tuple[TorchtitanNames | TorchtitanV02Names, ...]:
    """The spellings besides ours that an initial load accepts for Llama 3 (ModelFamily.checkpoint_spellings)."""
    return (TorchtitanNames(), TorchtitanV02Names())
