"""The single-device half of a model family: one value that builds, sizes, counts and converts its models.

A family's folder (``models/<family>/``) defines its ``ModelFamily``; ``dtrain.parallelize.families`` pairs it
with the family's parallelize plan into the spec the trainer looks up by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn


@dataclass(frozen=True)
class ModelFamily:
    """What the trainer needs of a family's models, without importing its modules by name.

    ``model_cls(args)`` builds a model that keeps the decoder protocol (``dtrain.models.decoder``);
    ``flops_per_token(args, seq_len)`` is the training FLOPs per token, for MFU; ``hf_adapter(args)`` converts its
    weights and config.json to and from Hugging Face's (``hf_name``, ``to_hf``, ``from_hf``, ``hf_config``,
    ``check_hf_config``, and ``args_from_hf_config`` on the class).
    """

    name: str
    model_cls: type[nn.Module]
    args_cls: type
    flavors: dict[str, Any]
    flops_per_token: Callable[[Any, int], int]
    hf_adapter: type
