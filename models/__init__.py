"""Single-device model families in plain PyTorch, installed as dtrain.models; nothing here imports the distributed package.

The trainer picks a family by name and a flavor of it, then builds the model without allocating memory::

    family = get_model_family("llama3")
    args = replace(family.flavors["8B"], vocab_size=..., max_seq_len=..., tie_word_embeddings=...)
    with torch.device("meta"):
        model = family.model_cls(args)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from .llama3 import LLAMA3_FLAVORS, Llama3Args, Transformer, num_flops_per_token
from .param_count import count_params


@dataclass(frozen=True)
class ModelFamily:
    """Everything the trainer needs to know about a family, without importing its modules by name."""

    name: str
    model_cls: type[nn.Module]
    args_cls: type
    flavors: dict[str, Any]
    # (args, seq_len) -> training FLOPs per token, for MFU.
    flops_per_token: Callable[[Any, int], int]


MODEL_FAMILIES: dict[str, ModelFamily] = {
    "llama3": ModelFamily(
        name="llama3",
        model_cls=Transformer,
        args_cls=Llama3Args,
        flavors=LLAMA3_FLAVORS,
        flops_per_token=num_flops_per_token,
    ),
}


def get_model_family(name: str) -> ModelFamily:
    """The family registered as ``name``; ValueError listing the valid names otherwise."""
    if name not in MODEL_FAMILIES:
        raise ValueError(f"unknown model family {name!r}; valid: {', '.join(sorted(MODEL_FAMILIES))}")
    return MODEL_FAMILIES[name]


__all__ = ["MODEL_FAMILIES", "ModelFamily", "count_params", "get_model_family"]
