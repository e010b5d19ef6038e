"""Hugging Face adapter of the Llama 3 family: LlamaForCausalLM's parameter names, attention layout and config.json.

Names: ours are torchtitan's (`layers.N.attention.wq.weight`, ...), HF's are `model.layers.N.self_attn.q_proj.weight`.

Layout: our RoPE (like Meta's reference and torchtitan) rotates feature pairs (2i, 2i+1) of each head; HF's
rotates halves, pairing feature i with i + head_dim/2. Both compute the same attention when wq's and wk's output
rows are reordered within every head, which is what HF's own Llama conversion does: row 2i+c of a head (c = 0, 1)
becomes row c * head_dim/2 + i. wv, wo and everything else keep their layout.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch

from ..rope import RopeScaling
from .args import Llama3Args

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_BLOCK_FQN = re.compile(r"^layers\.(\d+)\.(.+)$")
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def pairs_to_halves(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder a q/k projection's output rows from interleaved-pair RoPE (ours) to rotate-half RoPE (HF)."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_pairs(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `pairs_to_halves`: HF's rotate-half rows back to interleaved pairs."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def llama3_args_from_hf_config(config: dict[str, Any]) -> Llama3Args:
    """Llama3Args that reproduce a LlamaForCausalLM config.json (e.g. to convert a checkpoint without a flavor).

    Our args give the SwiGLU width by Meta's rounding rule; to reproduce any `intermediate_size` exactly, it becomes
    the rounding multiple, and the multiplier is chosen so the unrounded width is positive and no larger.
    """
    dim, intermediate = int(config["hidden_size"]), int(config["intermediate_size"])
    base = int(2 * (4 * dim) / 3)
    rope = rope_config(config)
    return Llama3Args(
        dim=dim,
        n_layers=int(config["num_hidden_layers"]),
        n_heads=int(config["num_attention_heads"]),
        n_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
        vocab_size=int(config["vocab_size"]),
        multiple_of=intermediate,
        ffn_dim_multiplier=None if base <= intermediate else intermediate / base,
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=_scaling_from(rope),
        max_seq_len=int(config.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def rope_config(config: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and scaling, from the classic keys (rope_theta, rope_scaling) or transformers 5's rope_parameters."""
    merged = dict(config.get("rope_scaling") or {})
    merged.update(config.get("rope_parameters") or {})
    if "rope_theta" in config:
        merged.setdefault("rope_theta", config["rope_theta"])
    return merged


def _scaling_from(rope: dict[str, Any]) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"rope_type {kind!r} is not Llama 3's (llama3 or default)")
    return RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


def check_hf_config_fields(adapter, config: dict[str, Any], checked: tuple[str, ...]) -> None:
    """ValueError naming the first of the `checked` args fields in which a HF config.json differs from the
    `adapter`'s model (one whose class reads config.json with ``args_from_hf_config``)."""
    try:
        theirs = adapter.args_from_hf_config(config)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"is not a {adapter.family} config ({type(err).__name__}: {err})") from None
    ours = adapter.args
    # max_seq_len is ours to choose per run; it changes no weight and no result within the trained length.
    theirs = replace(theirs, max_seq_len=ours.max_seq_len)
    for name in checked:
        if getattr(theirs, name) != getattr(ours, name):
            raise ValueError(f"has {name} = {getattr(theirs, name)}, this model has {getattr(ours, name)}")


class Llama3HFAdapter:
    """Converts one tensor at a time between our Llama 3 FQNs and LlamaForCausalLM's safetensors names.

    A family built on the same decoder (Qwen3) subclasses it: its extra block tensors go in ``IN_BLOCK``, its
    config.json in ``hf_config``/``args_from_hf_config``, and the settings compared on load in ``CHECKED_FIELDS``.
    """

    family = "llama3"
    # What a config.json of this family says in "architectures" / "model_type".
    HF_ARCHITECTURE, HF_MODEL_TYPE = "LlamaForCausalLM", "llama"
    # Other (architecture, model_type) pairs whose config.json args_from_hf_config reads (Qwen3's: Qwen3-MoE's).
    HF_OTHER_KINDS: tuple[tuple[str, str], ...] = ()
    args_from_hf_config = staticmethod(llama3_args_from_hf_config)
    IN_BLOCK = _IN_BLOCK
    CHECKED_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim", "head_dim",
                      "tie_word_embeddings", "rope_theta", "rope_scaling", "norm_eps")
    # Args fields a run starting from a config.json may set (they change no weight and no result of it).
    RUN_FIELDS: tuple[str, ...] = ("max_seq_len",)

    def __init__(self, args: Llama3Args):
        self.args = args

    def hf_name(self, fqn: str) -> str:
        """The HF tensor our `fqn` is read from (a tied head reads the embedding: HF stores no lm_head then)."""
        if fqn == "output.weight" and self.args.tie_word_embeddings:
            return _TOP_LEVEL["tok_embeddings.weight"]
        if fqn in _TOP_LEVEL:
            return _TOP_LEVEL[fqn]
        match = _BLOCK_FQN.match(fqn)
        if match and match.group(2) in self.IN_BLOCK:
            return f"model.layers.{match.group(1)}.{self.IN_BLOCK[match.group(2)]}"
        raise ValueError(f"no Hugging Face name for {self.family} parameter {fqn!r}")

    def hf_names(self, fqn: str) -> list[str]:
        """Every HF tensor our `fqn` is read from, in order, all of which `from_hf` takes: one here; a family that
        stacks several into one tensor (a MoE layer's experts) lists them all."""
        return [self.hf_name(fqn)]

    def _heads(self, fqn: str) -> int | None:
        """How many heads' features `fqn` lays out in RoPE's order (reordered between ours and HF's), if any.

        The q/k projections' output rows, and a QK-norm weight (one head's features, applied before RoPE).
        """
        if fqn.endswith("attention.wq.weight"):
            return self.args.n_heads
        if fqn.endswith("attention.wk.weight"):
            return self.args.n_kv_heads
        if fqn.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            return 1
        return None

    def _reorder(self, fqn: str, tensor: torch.Tensor, reorder) -> torch.Tensor:
        heads = self._heads(fqn)
        if heads is None:
            return tensor
        return reorder(tensor.unsqueeze(-1), heads).squeeze(-1) if tensor.ndim == 1 else reorder(tensor, heads)

    def to_hf(self, fqn: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """(HF name, tensor in HF's layout), or None for a tensor HF does not store (a tied head)."""
        if fqn == "output.weight" and self.args.tie_word_embeddings:
            return None
        return self.hf_name(fqn), self._reorder(fqn, tensor, pairs_to_halves)

    def to_hf_tensors(self, fqn: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Every (HF name, tensor in HF's layout) our `fqn` is written as: one, none for a tied head, and one per
        expert where a family stacks experts."""
        converted = self.to_hf(fqn, tensor)
        return [] if converted is None else [converted]

    def from_hf(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        """HF's tensor for our `fqn` (read from `hf_name(fqn)`) in our layout."""
        return self._reorder(fqn, tensor, halves_to_pairs)

    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        """config.json for LlamaForCausalLM with these weights."""
        a = self.args
        scaling = None
        if a.rope_scaling is not None:
            s = a.rope_scaling
            # "rope_type" is the key transformers reads now, "type" the one older versions read.
            scaling = {
                "rope_type": "llama3",
                "type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        return {
            "architectures": [self.HF_ARCHITECTURE],
            "model_type": self.HF_MODEL_TYPE,
            **self.decoder_hf_config(dtype),
            "rope_scaling": scaling,
            "mlp_bias": False,
        }

    def decoder_hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        """The config.json keys every family on the shared decoder writes the same way."""
        a = self.args
        return {
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "max_position_embeddings": a.max_seq_len,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "tie_word_embeddings": a.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "torch_dtype": HF_DTYPE_NAMES[dtype],
        }

    def check_hf_config(self, config: dict[str, Any]) -> None:
        """ValueError naming the first setting in which a HF config.json differs from this model."""
        check_hf_config_fields(self, config, self.CHECKED_FIELDS)
