"""DCP checkpoints as torchtitan writes them, made from our weights: v0.2 (its names are ours) and after v0.2.2 (its
main at b5bcd76, the coming 0.3). The names and layouts are written out here from torchtitan's model code, not
through dtrain's mapping, so that the tests check the mapping against them. (tests/reference has checkpoints that
torchtitan 0.2.2 itself wrote.)
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


def save_torchtitan_checkpoint(weights: dict[str, torch.Tensor], family: str, args, path: Path,
                               version: str = "0.3") -> None:
    """Save whole weights (by our FQN) in one process as a torchtitan model-only checkpoint of `version` ("0.2" or
    "0.3"): both in torchtitan's layout, "0.3" also under its names."""
    save_torchtitan_names({k: torchtitan_layout(family, args, k, v) for k, v in weights.items()}, path, version)


def save_torchtitan_names(weights: dict[str, torch.Tensor], path: Path, version: str = "0.3") -> None:
    """Save whole weights already in torchtitan's layout, keyed by our (= v0.2's) FQNs, under the names of torchtitan
    `version` ("0.2": as they are; "0.3": renamed)."""
    rename = torchtitan_name if version == "0.3" else (lambda fqn: fqn)
    dcp.save({rename(k): v.clone() for k, v in weights.items()}, checkpoint_id=str(path), no_dist=True)
