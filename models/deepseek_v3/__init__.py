"""The DeepSeek-V3 family (and DeepSeek-V2-Lite's shape): args and flavors, the MLA + MoE decoder, its FLOP count
by active parameters and the Hugging Face adapter. Its checkpoints use torchtitan's names, so it needs no other
spellings."""

from ..family import ModelFamily
from .args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from .flops import active_params, num_flops_per_token
from .hf_adapter import DeepSeekV3HFAdapter
from .model import DeepSeekV3Transformer, MultiHeadLatentAttention
from .yarn import YarnScaling

DEEPSEEK_V3 = ModelFamily(
    name="deepseek_v3",
    model_cls=DeepSeekV3Transformer,
    args_cls=DeepSeekV3Args,
    flavors=DEEPSEEK_V3_FLAVORS,
    flops_per_token=num_flops_per_token,
    hf_adapter=DeepSeekV3HFAdapter,
)

__all__ = [
    "DEEPSEEK_V3",
    "DEEPSEEK_V3_FLAVORS",
    "DeepSeekV3Args",
    "DeepSeekV3HFAdapter",
    "DeepSeekV3Transformer",
    "MultiHeadLatentAttention",
    "YarnScaling",
    "active_params",
    "num_flops_per_token",
]
