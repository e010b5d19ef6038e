"""DCP checkpoints as torchtitan after v0.2.2 writes them (its main at b5bcd76, the coming 0.3), made from our
weights. The names and layouts are written out here from torchtitan's model code, not through dtrain's mapping,
so that the tests check the mapping against them.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from dtrain.models.llama3.hf_adapter import pairs_to_halves


def torchtitan_name(fqn: str) -> str:
    """torchtitan's name of our `fqn`: q/k/v under attention.qkv_linear, the head as lm_head."""
    if fqn == "output.weight":
        return "lm_head.weight"
    return re.sub(r"\.attention\.(w[qkv])\.weight$", r".attention.qkv_linear.\1.weight", fqn)


def torchtitan_layout(family: str, args, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
    """Our tensor in torchtitan's layout: Qwen3 there rotates the halves of each head in RoPE (HF's order), so the
    rows of wq, wk and the QK-norm weights are reordered; Llama 3 rotates interleaved pairs there, as here."""
    if family != "qwen3":
        return tensor
    heads = {"attention.wq.weight": args.n_heads, "attention.wk.weight": args.n_kv_heads,
             "attention.q_norm.weight": 1, "attention.k_norm.weight": 1}
    for suffix, n in heads.items():
        if fqn.endswith(suffix):
            return pairs_to_halves(tensor.reshape(tensor.shape[0], -1), n).reshape(tensor.shape)
    return tensor


def save_torchtitan_checkpoint(weights: dict[str, torch.Tensor], family: str, args, path: Path) -> None:
    """Save whole weights (by our FQN) in one process as a torchtitan >= 0.3 model-only checkpoint."""
    stored = {torchtitan_name(k): torchtitan_layout(family, args, k, v).clone() for k, v in weights.items()}
    dcp.save(stored, checkpoint_id=str(path), no_dist=True)
