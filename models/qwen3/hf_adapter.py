"""Hugging Face adapter of the Qwen3 family: Qwen3ForCausalLM's (dense) and Qwen3MoeForCausalLM's names, layouts
and config.json.

Qwen3's checkpoints use Llama's names plus ``self_attn.q_norm``/``k_norm``, and HF's rotate-half RoPE, so the
conversion is Llama's (``models/llama3/hf_adapter.py``): q/k projection rows are reordered within each head, and
so is each QK-norm weight, which scales one head's features before RoPE.

Qwen3-MoE's blocks hold ``mlp.gate`` (the router, our ``moe.router.gate``) and one SwiGLU per expert,
``mlp.experts.{i}.gate_proj/up_proj/down_proj``, which our ``moe.experts.w1/w3/w2`` stack along a first dimension
of experts: each of those tensors is read from, and written as, ``num_experts`` HF tensors (``hf_names``).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..llama3.hf_adapter import Llama3HFAdapter, rope_config
from .args import Qwen3Args

HF_MOE_ARCHITECTURE, HF_MOE_MODEL_TYPE = "Qwen3MoeForCausalLM", "qwen3_moe"
_EXPERTS_FQN = re.compile(r"^layers\.(\d+)\.moe\.experts\.(w1|w2|w3)$")
_EXPERT_PROJECTION = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def qwen3_args_from_hf_config(config: dict[str, Any]) -> Qwen3Args:
    """Qwen3Args that reproduce a Qwen3ForCausalLM or Qwen3MoeForCausalLM config.json; a ValueError naming the
    field for a setting this model cannot represent."""
    model_type = config.get("model_type", "qwen3")
    if model_type not in ("qwen3", HF_MOE_MODEL_TYPE):
        raise ValueError(f"model_type {model_type!r} is not qwen3 or {HF_MOE_MODEL_TYPE}")
    if config.get("use_sliding_window"):
        raise ValueError("use_sliding_window = true is not supported (causal attention over the whole sequence only)")
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
        **(_moe_fields(config) if model_type == HF_MOE_MODEL_TYPE else {}),
    )


def _moe_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The moe_* fields of a Qwen3MoeForCausalLM config.json, whose defaults are Qwen3MoeConfig's."""
    # transformers 5 writes num_experts under its internal name, num_local_experts.
    num_experts = int(config.get("num_experts", config.get("num_local_experts", 128)))
    if num_experts == 0:  # HF then builds every block with the dense MLP, under the dense model's names
        return {}
    if config.get("mlp_only_layers"):
        raise ValueError(f"mlp_only_layers = {config['mlp_only_layers']} is not supported (every block routes to "
                         "experts here: valid is [])")
    if int(config.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(f"decoder_sparse_step = {config['decoder_sparse_step']} is not supported (every block "
                         "routes to experts here: valid is 1)")
    return dict(
        moe_num_experts=num_experts,
        moe_top_k=int(config.get("num_experts_per_tok", 8)),
        moe_hidden_dim=int(config.get("moe_intermediate_size", 768)),
        moe_route_norm=bool(config.get("norm_topk_prob", False)),
        moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.001)),
        moe_load_balance_bias=False,
    )


class Qwen3HFAdapter(Llama3HFAdapter):
    """Converts between our Qwen3 FQNs and Qwen3ForCausalLM's (dense) or Qwen3MoeForCausalLM's safetensors names;
    one tensor at a time, except the experts (``hf_names``)."""

    family = "qwen3"
    HF_ARCHITECTURE, HF_MODEL_TYPE = "Qwen3ForCausalLM", "qwen3"
    HF_OTHER_KINDS = ((HF_MOE_ARCHITECTURE, HF_MOE_MODEL_TYPE),)
    args_from_hf_config = staticmethod(qwen3_args_from_hf_config)
    IN_BLOCK = {
        **Llama3HFAdapter.IN_BLOCK,
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
        "moe.router.gate.weight": "mlp.gate.weight",
    }
    CHECKED_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size",
                      "tie_word_embeddings", "rope_theta", "norm_eps", "moe_num_experts", "moe_top_k",
                      "moe_hidden_dim", "moe_route_norm")
    # The balancing loss's weight is training's (router_aux_loss_coef changes no logit).
    RUN_FIELDS = ("max_seq_len", "moe_aux_loss_coeff")

    def hf_name(self, fqn: str) -> str:
        if fqn.endswith("moe.expert_bias"):
            raise ValueError(f"{fqn} (moe_load_balance_bias) has no Hugging Face counterpart: "
                             f"{HF_MOE_ARCHITECTURE} routes without a bias")
        return super().hf_name(fqn)

    def hf_names(self, fqn: str) -> list[str]:
        """The HF tensors our `fqn` is made of: those of every expert, in order, for a stacked expert weight."""
        match = _EXPERTS_FQN.match(fqn)
        if match is None:
            return super().hf_names(fqn)
        layer, weight = match.groups()
        prefix = f"model.layers.{layer}.mlp.experts"
        return [f"{prefix}.{i}.{_EXPERT_PROJECTION[weight]}.weight" for i in range(self.args.moe_num_experts)]

    def from_hf(self, fqn: str, *tensors: torch.Tensor) -> torch.Tensor:
        """HF's tensors for our `fqn` (read from `hf_names(fqn)`) in our layout."""
        if _EXPERTS_FQN.match(fqn):
            return torch.stack(tensors)
        return super().from_hf(fqn, *tensors)

    def to_hf_tensors(self, fqn: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if _EXPERTS_FQN.match(fqn):
            return list(zip(self.hf_names(fqn), tensor.unbind(0)))
        return super().to_hf_tensors(fqn, tensor)

    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        """config.json for Qwen3ForCausalLM, or Qwen3MoeForCausalLM for a model with experts, with these weights."""
        a = self.args
        if not a.moe_num_experts:
            return {
                "architectures": [self.HF_ARCHITECTURE],
                "model_type": self.HF_MODEL_TYPE,
                **self.decoder_hf_config(dtype),
                "use_sliding_window": False,
            }
        if a.moe_load_balance_bias:
            raise ValueError(f"moe_load_balance_bias = true has no Hugging Face counterpart: {HF_MOE_ARCHITECTURE} "
                             "routes without a bias")
        return {
            "architectures": [HF_MOE_ARCHITECTURE],
            "model_type": HF_MOE_MODEL_TYPE,
            **self.decoder_hf_config(dtype),
            "use_sliding_window": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "num_experts": a.moe_num_experts,
            "num_experts_per_tok": a.moe_top_k,
            "moe_intermediate_size": a.moe_hidden_dim,
            "norm_topk_prob": a.moe_route_norm,
            "router_aux_loss_coef": a.moe_aux_loss_coeff,
            "output_router_logits": False,
        }
