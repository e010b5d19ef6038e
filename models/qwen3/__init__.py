"""The Qwen3 family, dense and mixture-of-experts (Qwen3-MoE, the ``debugmodel_moe*``, ``30B-A3B`` and ``235B-A22B``
flavors): args and flavors, the shared decoder with QK-norm, its FLOP count, HF adapter and the names (and RoPE
order) newer torchtitan checkpoints give its weights."""

from ..family import ModelFamily
from ..flops import num_flops_per_token
from .args import QWEN3_FLAVORS, Qwen3Args
from .hf_adapter import Qwen3HFAdapter
from .model import Qwen3Transformer
from .torchtitan_names import torchtitan_spellings

QWEN3 = ModelFamily(
    name="qwen3",
    model_cls=Qwen3Transformer,
    args_cls=Qwen3Args,
    flavors=QWEN3_FLAVORS,
    flops_per_token=num_flops_per_token,
    hf_adapter=Qwen3HFAdapter,
    checkpoint_spellings=torchtitan_spellings,
)

__all__ = ["QWEN3", "QWEN3_FLAVORS", "Qwen3Args", "Qwen3HFAdapter", "Qwen3Transformer"]
