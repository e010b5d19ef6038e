"""Hugging Face adapter of the Qwen3 family: Qwen3ForCausalLM's names, layouts and config.json.

Qwen3's checkpoints use Llama's names plus ``self_attn.q_norm``/``k_norm``, and HF's rotate-half RoPE, so the
conversion is Llama's (``models/llama3/hf_adapter.py``): q/k projection rows are reordered within each head, and
so is each QK-norm weight, which scales one head's features before RoPE.
"""

from __future__ import annotations

from typing import Any

import torch

from ..llama3.hf_adapter import Llama3HFAdapter, rope_config
from .args import Qwen3Args


def qwen3_args_from_hf_config(config: dict[str, Any]) -> Qwen3Args:
    """Qwen3Args that reproduce a Qwen3ForCausalLM config.json."""
    if config.get("model_type", "qwen3") != "qwen3":
        raise ValueError(f"model_type {config['model_type']!r} is not qwen3")
    rope = rope_config(config)
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported for qwen3 (default only)")
    n_heads = int(config["num_attention_heads"])
    return Qwen3Args(
        dim=int(config["hidden_size"]),
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // n_heads),
        hidden_dim=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", 1000000.0)),
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


class Qwen3HFAdapter(Llama3HFAdapter):
    """Converts one tensor at a time between our Qwen3 FQNs and Qwen3ForCausalLM's safetensors names."""

    family = "qwen3"
    HF_ARCHITECTURE, HF_MODEL_TYPE = "Qwen3ForCausalLM", "qwen3"
    args_from_hf_config = staticmethod(qwen3_args_from_hf_config)
    IN_BLOCK = {
        **Llama3HFAdapter.IN_BLOCK,
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    }
    CHECKED_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size",
                      "tie_word_embeddings", "rope_theta", "norm_eps")

    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        """config.json for Qwen3ForCausalLM with these weights."""
        return {
            "architectures": [self.HF_ARCHITECTURE],
            "model_type": self.HF_MODEL_TYPE,
            **self.decoder_hf_config(dtype),
            "use_sliding_window": False,
        }
