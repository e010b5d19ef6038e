"""The decoder protocol: what code outside a model family may know about the structure of its model.

Every family here is a decoder-only language model: ``embedding -> blocks -> final norm -> head``. Shared code
(FSDP wrapping, the pipeline split and its config checks) reads the names of those parts from the model class's
``decoder_layout`` and never spells a module name itself, so a family with other names needs no change there.

What a family's model class promises besides the names:
- ``blocks`` is an ``nn.ModuleDict`` keyed ``"0" .. "N-1"`` in forward order, so a block keeps its name (and its
  parameters' names) when others are deleted;
- the embedding, the final norm and the head may be set to ``None`` and the forward then passes through what is
  left: a pipeline stage is the model with the parts other stages own removed;
- a head that shares its weight with the embedding (tied) shares the very parameter object;
- ``init_buffers(device)`` computes the buffers that come from the args and no checkpoint (the RoPE table), so a
  model built on the meta device and then loaded from a checkpoint needs no random initialisation.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class DecoderLayout:
    """The top-level module names of a decoder, in forward order."""

    embedding: str
    blocks: str
    final_norm: str
    head: str

    def block(self, index: int) -> str:
        """The full name of block `index`, e.g. ``layers.3``."""
        return f"{self.blocks}.{index}"

    def block_index(self, name: str) -> int | None:
        """The index of the block called `name`, or None when `name` is not a block."""
        prefix, _, index = name.partition(".")
        return int(index) if prefix == self.blocks and index.isdigit() else None

    @property
    def optional_parts(self) -> tuple[str, str, str]:
        """The parts besides the blocks, each of which a pipeline stage may lack."""
        return (self.embedding, self.final_norm, self.head)

    def module_names(self, n_layers: int) -> list[str]:
        """Every top-level module in forward order: the embedding, each block, the final norm, the head."""
        return [self.embedding, *(self.block(i) for i in range(n_layers)), self.final_norm, self.head]

    def pipeline_units(self, n_layers: int) -> list[list[str]]:
        """The pieces a pipeline split never cuts: the embedding, each block, and the final norm with the head."""
        return [[self.embedding], *([self.block(i)] for i in range(n_layers)), [self.final_norm, self.head]]

    def blocks_of(self, model: nn.Module) -> nn.ModuleDict:
        return getattr(model, self.blocks)

    def part(self, model: nn.Module, name: str) -> nn.Module | None:
        """The embedding, final norm or head of `model` (None where this model or stage lacks it)."""
        return getattr(model, name)


def decoder_layout(model: nn.Module) -> DecoderLayout:
    """The layout of a model (or pipeline stage) of any registered family."""
    layout = getattr(type(model), "decoder_layout", None)
    if not isinstance(layout, DecoderLayout):
        raise TypeError(f"{type(model).__name__} does not declare a decoder_layout (see dtrain.models.decoder)")
    return layout
