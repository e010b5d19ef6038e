"""The Llama 3 family (3, 3.1, 3.2 text models): args and flavors, the shared pre-norm decoder as its model, its
FLOP count, HF adapter, and the names newer torchtitan checkpoints give its weights."""

from ..family import ModelFamily
from ..flops import matmul_params, num_flops_per_token
from ..layers import FeedForward, RMSNorm
from ..rope import RopeScaling, apply_rotary_emb, precompute_rope_cache, rope_frequencies
from ..transformer import Attention, Transformer, TransformerBlock
from .args import LLAMA3_FLAVORS, Llama3Args
from .hf_adapter import Llama3HFAdapter
from .torchtitan_names import torchtitan_spellings

LLAMA3 = ModelFamily(
    name="llama3",
    model_cls=Transformer,
    args_cls=Llama3Args,
    flavors=LLAMA3_FLAVORS,
    flops_per_token=num_flops_per_token,
    hf_adapter=Llama3HFAdapter,
    checkpoint_spellings=torchtitan_spellings,
)

__all__ = [
    "LLAMA3",
    "LLAMA3_FLAVORS",
    "Attention",
    "FeedForward",
    "Llama3Args",
    "Llama3HFAdapter",
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
