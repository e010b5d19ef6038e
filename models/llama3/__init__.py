"""The Llama 3 family (3, 3.1, 3.2 text models): args and flavors, the model, and its FLOP count."""

from .args import LLAMA3_FLAVORS, Llama3Args, RopeScaling
from .flops import matmul_params, num_flops_per_token
from .model import Attention, FeedForward, RMSNorm, Transformer, TransformerBlock
from .rope import apply_rotary_emb, precompute_rope_cache, rope_frequencies

__all__ = [
    "LLAMA3_FLAVORS",
    "Attention",
    "FeedForward",
    "Llama3Args",
    "RMSNorm",
    "RopeScaling",
    "Transformer",
    "TransformerBlock",
    "apply_rotary_emb",
    "matmul_params",
    "num_flops_per_token",
    "precompute_rope_cache",
    "rope_frequencies",
]
