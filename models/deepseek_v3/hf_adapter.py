"""Hugging Face adapter of the DeepSeek-V3 family: DeepseekV3ForCausalLM's names, expert layout and config.json.

Names: ours are torchtitan's (``layers.N.attention.wkv_a.weight``, ...), HF's ``model.layers.N.self_attn.
kv_a_proj_with_mqa.weight``, ... Every tensor keeps its layout, except that HF stores each routed expert's
projections separately (``mlp.experts.J.gate_proj.weight``, ...) where we stack them (``moe.experts.w1``
``[E, hidden, dim]``, ``w3``, ``w2``). RoPE needs no reordering (HF's ``rope_interleave`` default). What either
side computes that the other cannot represent is refused in one line (docs/models.md, "DeepSeek-V3 and Hugging
Face" lists it).

The interface is the one dtrain/checkpoint/hf_io.py reads and writes through: ``hf_names``, ``from_hf``,
``to_hf_tensors`` (one of our tensors may stack several of HF's), ``hf_config``, ``check_hf_config``.
"""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

import torch

from ..llama3.hf_adapter import HF_DTYPE_NAMES, check_hf_config_fields, rope_config
from .args import DeepSeekV3Args
from .yarn import YarnScaling

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
# Our stacked expert weight -> the projection each HF expert J stores as mlp.experts.J.<projection>.weight.
_STACKED = {"moe.experts.w1": "gate_proj", "moe.experts.w2": "down_proj", "moe.experts.w3": "up_proj"}
# transformers' DeepseekV3 (as DeepSeek's own code) builds the q/kv latent norms with its RMSNorm's default eps, not
# with rms_norm_eps (modeling_deepseek_v3.py: DeepseekV3RMSNorm(config.kv_lora_rank)).
HF_LATENT_NORM_EPS = 1e-6
_BLOCK_FQN = re.compile(r"^layers\.(\d+)\.(.+)$")
# What a config.json determines, as computed (the YaRN in effect at the run's max_seq_len, every norm's eps); the
# other fields (moe_aux_loss_coeff, moe_bias_update_speed, max_seq_len) are choices of a run.
_CHECKED = ("dim", "n_layers", "n_dense_layers", "hidden_dim", "n_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size", "norm_eps", "latent_norm_eps",
            "final_norm_dtype_eps", "rope_theta", "active_rope_scaling", "tie_word_embeddings", "moe_num_experts",
            "moe_top_k", "moe_hidden_dim", "moe_num_shared_experts", "moe_score_func", "moe_route_norm",
            "moe_route_scale", "moe_num_expert_groups", "moe_num_limited_groups", "moe_load_balance_bias")


def _refuse_unrepresentable(config: dict[str, Any], rope: dict[str, Any]) -> None:
    """ValueError naming the first setting of a DeepseekV3 config.json this family cannot compute."""
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ValueError(f"is quantized ({method}); dequantize it to bf16 or fp32 first")
    if config.get("rope_interleave", True) is False:
        raise ValueError("has rope_interleave false (rotate-half RoPE); only interleaved pairs are supported")
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"has scoring_func {config['scoring_func']!r}; DeepseekV3ForCausalLM routes by sigmoid")
    if config.get("attention_bias", False):
        raise ValueError("has attention_bias true; this family's projections have no biases")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"has hidden_act {config['hidden_act']!r}; only silu (SwiGLU) is supported")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    if kv_heads not in (None, heads):
        raise ValueError(f"has num_key_value_heads {kv_heads}; MLA needs num_attention_heads ({heads})")
    if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
        raise ValueError("sets rope attention_factor or truncate; only YaRN's defaults for them are supported")


def _yarn_from(rope: dict[str, Any]) -> YarnScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"has rope_type {kind!r}; DeepSeek-V3 supports yarn or default")
    return YarnScaling(
        factor=float(rope["factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        # Absent is 0, which Hugging Face's rule treats as not given (yarn.py).
        mscale=float(rope.get("mscale") or 0),
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
    )


def deepseek_v3_args_from_hf_config(config: dict[str, Any]) -> DeepSeekV3Args:
    """DeepSeekV3Args that reproduce a DeepseekV3ForCausalLM config.json; ValueError for what they cannot."""
    if config.get("model_type", "deepseek_v3") != "deepseek_v3":
        raise ValueError(f"has model_type {config['model_type']!r}, not deepseek_v3")
    rope = rope_config(config)
    _refuse_unrepresentable(config, rope)
    return DeepSeekV3Args(
        dim=int(config["hidden_size"]),
        n_layers=int(config["num_hidden_layers"]),
        n_dense_layers=int(config.get("first_k_dense_replace") or 0),
        hidden_dim=int(config["intermediate_size"]),
        n_heads=int(config["num_attention_heads"]),
        q_lora_rank=int(config.get("q_lora_rank") or 0),
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        vocab_size=int(config["vocab_size"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        latent_norm_eps=HF_LATENT_NORM_EPS,
        final_norm_dtype_eps=False,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=_yarn_from(rope),
        # HF applies YaRN at every length.
        rope_scaling_beyond_original_only=False,
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        moe_num_experts=int(config["n_routed_experts"]),
        moe_top_k=int(config["num_experts_per_tok"]),
        moe_hidden_dim=int(config["moe_intermediate_size"]),
        moe_num_shared_experts=int(config.get("n_shared_experts") or 0),
        moe_score_func="sigmoid",
        moe_route_norm=bool(config.get("norm_topk_prob", True)),
        moe_route_scale=float(config.get("routed_scaling_factor", 1.0)),
        moe_num_expert_groups=int(config.get("n_group") or 1),
        moe_num_limited_groups=int(config.get("topk_group") or 1),
        # HF's router always adds its e_score_correction_bias when choosing experts.
        moe_load_balance_bias=True,
    )


class DeepSeekV3HFAdapter:
    """Converts between our DeepSeek-V3 FQNs and DeepseekV3ForCausalLM's safetensors names and layouts."""

    family = "deepseek_v3"
    HF_ARCHITECTURE, HF_MODEL_TYPE = "DeepseekV3ForCausalLM", "deepseek_v3"
    HF_OTHER_KINDS: tuple[tuple[str, str], ...] = ()
    args_from_hf_config = staticmethod(deepseek_v3_args_from_hf_config)
    # Args fields a run starting from a config.json may set: the choices of a run that _CHECKED leaves out.
    RUN_FIELDS = ("max_seq_len", "moe_aux_loss_coeff", "moe_bias_update_speed")

    def __init__(self, args: DeepSeekV3Args):
        self.args = args

    def _block_part(self, fqn: str) -> tuple[str, str] | None:
        match = _BLOCK_FQN.match(fqn)
        return (match.group(1), match.group(2)) if match else None

    def _is_stacked(self, fqn: str) -> bool:
        block = self._block_part(fqn)
        return block is not None and block[1] in _STACKED

    def hf_names(self, fqn: str) -> list[str]:
        """The HF tensors our `fqn` is read from: one, or one per expert for a stacked expert weight (a tied head
        reads the embedding: HF stores no lm_head then)."""
        if fqn == "output.weight" and self.args.tie_word_embeddings:
            return [_TOP_LEVEL["tok_embeddings.weight"]]
        if fqn in _TOP_LEVEL:
            return [_TOP_LEVEL[fqn]]
        block = self._block_part(fqn)
        if block is not None and block[1] in _IN_BLOCK:
            return [f"model.layers.{block[0]}.{_IN_BLOCK[block[1]]}"]
        if block is not None and block[1] in _STACKED:
            experts = range(self.args.moe_num_experts)
            return [f"model.layers.{block[0]}.mlp.experts.{j}.{_STACKED[block[1]]}.weight" for j in experts]
        raise ValueError(f"no Hugging Face name for {self.family} parameter {fqn!r}")

    def from_hf(self, fqn: str, *tensors: torch.Tensor) -> torch.Tensor:
        """Our `fqn` from the HF tensors ``hf_names(fqn)`` names, in that order: stacked experts, or the one tensor
        unchanged."""
        return torch.stack(tensors) if self._is_stacked(fqn) else tensors[0]

    def to_hf_tensors(self, fqn: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs that store our `fqn`: none for a tied head, one per expert for a stacked weight,
        and with a router's gate the zero routing bias HF expects of a model trained without one."""
        self._check_exportable()
        if fqn == "output.weight" and self.args.tie_word_embeddings:
            return []
        names = self.hf_names(fqn)
        pairs = list(zip(names, tensor.unbind(0))) if self._is_stacked(fqn) else [(names[0], tensor)]
        if fqn.endswith("moe.router.gate.weight") and not self.args.moe_load_balance_bias:
            bias_name = names[0].replace("gate.weight", "gate.e_score_correction_bias")
            pairs.append((bias_name, torch.zeros(tensor.shape[0], dtype=torch.float32, device=tensor.device)))
        return pairs

    def _check_exportable(self) -> None:
        """ValueError naming the first args field whose value DeepseekV3ForCausalLM cannot compute."""
        a = self.args
        if a.moe_score_func != "sigmoid":
            raise ValueError(
                f"model.args.moe_score_func = {a.moe_score_func!r} has no DeepseekV3ForCausalLM form "
                "(it routes by sigmoid)"
            )
        if a.latent_norm_eps != HF_LATENT_NORM_EPS:
            raise ValueError(
                f"model.args.latent_norm_eps = {a.latent_norm_eps} has no DeepseekV3ForCausalLM form (its q/kv latent "
                f"norms take eps {HF_LATENT_NORM_EPS} whatever rms_norm_eps is; valid: {HF_LATENT_NORM_EPS})"
            )
        if a.final_norm_dtype_eps:
            raise ValueError(
                "model.args.final_norm_dtype_eps = true has no DeepseekV3ForCausalLM form (its final norm takes "
                "rms_norm_eps, our norm_eps; valid: false)"
            )

    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        """config.json for DeepseekV3ForCausalLM with these weights."""
        self._check_exportable()
        # The YaRN this model computes with at its max_seq_len: HF applies whatever config.json gives at every length.
        a, yarn = self.args, self.args.active_rope_scaling
        scaling = None
        if yarn is not None:
            # "rope_type" is the key transformers reads now, "type" the one DeepSeek's own configs (and older
            # transformers) use.
            scaling = {"rope_type": "yarn", "type": "yarn", **{f.name: getattr(yarn, f.name) for f in fields(yarn)}}
        return {
            "architectures": [self.HF_ARCHITECTURE],
            "model_type": self.HF_MODEL_TYPE,
            "hidden_size": a.dim,
            "num_hidden_layers": a.n_layers,
            "first_k_dense_replace": a.n_dense_layers,
            "intermediate_size": a.hidden_dim,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_heads,
            "q_lora_rank": a.q_lora_rank or None,
            "kv_lora_rank": a.kv_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim,
            "vocab_size": a.vocab_size,
            "max_position_embeddings": a.max_seq_len,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": scaling,
            "rope_interleave": True,
            "tie_word_embeddings": a.tie_word_embeddings,
            "n_routed_experts": a.moe_num_experts,
            "num_experts_per_tok": a.moe_top_k,
            "moe_intermediate_size": a.moe_hidden_dim,
            "n_shared_experts": a.moe_num_shared_experts,
            "norm_topk_prob": a.moe_route_norm,
            "routed_scaling_factor": a.moe_route_scale,
            "n_group": a.moe_num_expert_groups,
            "topk_group": a.moe_num_limited_groups,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "num_nextn_predict_layers": 0,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "torch_dtype": HF_DTYPE_NAMES[dtype],
        }

    def check_hf_config(self, config: dict[str, Any]) -> None:
        """ValueError naming the first setting in which a HF config.json differs from this model."""
        check_hf_config_fields(self, config, _CHECKED)
