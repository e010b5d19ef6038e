"""The decoder protocol: what code outside a model family may know about its model and its args.

Every family here is a decoder-only language model: ``embedding -> blocks -> final norm -> head``. Shared code
(parallelize/, the memory pre-flight, the estimator) reads the names of those parts, and of each block's attention
and its inner-attention seam, from the model class's ``decoder_layout`` and never spells a module name itself (the
tensor-parallel plans alone name paths inside a block); it reads the args only through ``DecoderArgs``. A family
with other names or another block shape declares its layout and satisfies ``DecoderArgs`` from its own fields.

What a model class promises besides the names (``blocks`` an ``nn.ModuleDict`` keyed ``"0" .. "N-1"``; embedding,
final norm and head settable to ``None``; a tied head sharing the very ``weight``; the attention signature
``(x, rope_cache, positions, document_ids=None)``; ``args``; ``init_buffers(device)``): docs/models.md, "What a
family is"; adding one: docs/models.md, "Adding a family".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import nn

from .moe import MoEArgs


class DecoderArgs(Protocol):
    """The model-arg fields that shared code reads (a family's args class may hold any others).

    Sizes are those the attention kernels and the matmuls see, which is what memory, FLOP and tensor-parallel
    arithmetic needs: a family whose attention is built otherwise (DeepSeek-V3's latent attention) derives them
    from its own fields.
    """

    @property
    def dim(self) -> int:
        """Width of the residual stream (the embedding's)."""

    @property
    def n_layers(self) -> int:
        """Number of blocks."""

    @property
    def n_heads(self) -> int:
        """Query heads per block (what tensor parallel splits)."""

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads the inner attention receives (n_heads without grouping)."""

    @property
    def head_dim(self) -> int:
        """Features per query and key head the inner attention receives."""

    @property
    def ffn_hidden_dim(self) -> int:
        """Width of the dense SwiGLU feed-forward (what tensor parallel splits)."""

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding, columns of the head."""

    @property
    def max_seq_len(self) -> int:
        """Longest sequence the RoPE table covers."""

    @property
    def tie_word_embeddings(self) -> bool:
        """Whether the head is the embedding's weight."""

    @property
    def moe(self) -> MoEArgs | None:
        """The mixture-of-experts feed-forward of the blocks that have one (None: every block is dense)."""


@dataclass(frozen=True)
class DecoderLayout:
    """The module names of a decoder: its top-level parts in forward order, then names inside each block."""

    embedding: str
    blocks: str
    final_norm: str
    head: str
    # A block's attention module, and the inner attention inside that (the seam context parallel swaps).
    attention: str
    inner_attention: str

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

    def attention_of(self, block: nn.Module) -> nn.Module:
        return getattr(block, self.attention)

    def set_inner_attention(self, block: nn.Module, inner: nn.Module) -> None:
        """Make `inner` the inner attention of `block`'s attention."""
        setattr(self.attention_of(block), self.inner_attention, inner)

    def tie_head(self, model: nn.Module) -> None:
        """Make the head's weight the embedding's parameter again (after something replaced one of them)."""
        self.part(model, self.head).weight = self.part(model, self.embedding).weight


def decoder_layout(model: nn.Module) -> DecoderLayout:
    """The layout of a model (or pipeline stage) of any registered family."""
    layout = getattr(type(model), "decoder_layout", None)
    if not isinstance(layout, DecoderLayout):
        raise TypeError(f"{type(model).__name__} does not declare a decoder_layout (see dtrain.models.decoder)")
    return layout
