"""The single-device half of a model family: one value that builds, sizes, counts and converts its models.

A family's folder (``models/<family>/``) defines its ``ModelFamily``; ``dtrain.parallelize.families`` pairs it
with the family's parallelize plan into the spec the trainer looks up by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from .decoder import DecoderArgs


class WeightSpelling(Protocol):
    """Another way a checkpoint may name (and lay out) a family's weights, e.g. a newer torchtitan's.

    A spelling renames, and may reorder a tensor's elements, but never changes a shape.
    """

    writer: str  # who writes checkpoints spelled so, for the log
    project: str  # that writer as checkpoint.initial_load_writer names it, e.g. "torchtitan"
    # Whether some tensor is stored in another order (to_ours is not None for it): with our names, such a
    # spelling cannot be told from ours by the names alone.
    reorders: bool

    def stored_name(self, fqn: str) -> str:
        """The checkpoint's key for our parameter `fqn`."""

    def to_ours(self, fqn: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """How the whole stored tensor of `fqn` becomes ours; None when it already is (it then loads straight
        into this rank's shards)."""


def no_other_spellings(args: DecoderArgs) -> tuple[WeightSpelling, ...]:
    """For a family whose checkpoints only ever use our names."""
    return ()


@dataclass(frozen=True)
class ModelFamily:
    """What the trainer needs of a family's models, without importing its modules by name.

    ``model_cls(args)`` builds a model that keeps the decoder protocol (``dtrain.models.decoder``);
    ``flops_per_token(args, seq_len)`` is the training FLOPs per token, for MFU; ``hf_adapter(args)`` converts its
    weights and config.json to and from Hugging Face's (``hf_names``, ``from_hf``, ``to_hf_tensors``, which let one
    of our tensors stack several of HF's; ``hf_config``, ``check_hf_config``; on the class ``args_from_hf_config``,
    ``HF_ARCHITECTURE``, ``HF_MODEL_TYPE``, ``HF_OTHER_KINDS``, ``RUN_FIELDS``; ``models/llama3/hf_adapter.py`` is
    the base to build on); ``checkpoint_spellings(args)`` are the other names a DCP checkpoint may give its weights,
    tried in order when an initial load does not find ours.
    """

    name: str
    model_cls: type[nn.Module]
    args_cls: type
    flavors: dict[str, DecoderArgs]
    flops_per_token: Callable[[DecoderArgs, int], int]
    hf_adapter: type
    checkpoint_spellings: Callable[[DecoderArgs], tuple[WeightSpelling, ...]] = no_other_spellings
