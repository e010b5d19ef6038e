"""Document masking through FlexAttention block masks: the packed-sequence attention that scales (CUDA).

The dense path (``CausalSDPA`` with ``document_causal_mask``) hands SDPA a ``[seq, seq]`` mask, which SDPA keeps for
backward as an additive mask in the compute dtype: memory grows with the square of the sequence, and every masked
score is still computed. A ``BlockMask`` (torch's ``create_block_mask``) records, per 128 x 128 tile, whether it is
empty, full or partial; ``flex_attention`` then skips the empty tiles (the other documents, the future) and applies
the mask element by element only in the partial ones, so nothing of size ``seq²`` is ever stored.

Both are compiled on CUDA, as torchtitan's ``FlexAttentionWrapper`` does: uncompiled, ``flex_attention`` runs an
unfused reference that materialises the whole score matrix, and ``create_block_mask`` evaluates the mask over the
whole grid at once. Inside a compiled block the compiled handles are inlined into the block's graph. On CPU the
uncompiled reference runs, forward only: FlexAttention has no CPU backward, so the trainer keeps the dense path
there (``training.attention_mask_backend``) and the CPU uses this one for the tests that compare it with the dense
mask.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from .attention import CausalSDPA
from .decoder import decoder_layout

# Module-level, so that every block shares one compiled function (lazy: nothing compiles until the first CUDA call).
_compiled_flex_attention = torch.compile(flex_attention)
_compiled_create_block_mask = torch.compile(create_block_mask)


def document_block_mask(
    q_positions: torch.Tensor, kv_positions: torch.Tensor, q_documents: torch.Tensor, kv_documents: torch.Tensor
) -> BlockMask:
    """Query ``i`` may attend to key ``j`` when ``j`` is not after ``i`` and both are in the same document.

    ``*_positions [len]`` are the tokens' positions in their sequence and ``*_documents [batch, len]`` their
    documents; queries and keys differ under context parallel (this rank's queries, every rank's keys in the
    all-gather's order), the mask being exact for any order.
    """

    def same_document_causal(b, h, q_idx, kv_idx):
        causal = q_positions[q_idx] >= kv_positions[kv_idx]
        return causal & (q_documents[b, q_idx] == kv_documents[b, kv_idx])

    build = _compiled_create_block_mask if q_positions.is_cuda else create_block_mask
    return build(
        same_document_causal, B=q_documents.shape[0], H=None, Q_LEN=q_positions.shape[0],
        KV_LEN=kv_positions.shape[0], device=q_positions.device,
    )


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """Queries ``[b, s_q, heads, d]`` over keys and values ``[b, s_k, kv_heads, d]`` (grouped: flex_attention maps
    query head ``h`` to kv head ``h // (heads / kv_heads)``, as ``repeat_kv`` does, without repeating them)."""
    attend = _compiled_flex_attention if q.is_cuda else flex_attention
    out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask, enable_gqa=True)
    return out.transpose(1, 2)


class FlexDocumentAttention(CausalSDPA):
    """``CausalSDPA`` whose document masking runs through a block mask; without ``document_ids`` it is the plain
    causal SDPA (the fused causal kernels need no mask).

    The block mask is built in each layer from the ``document_ids`` the model hands every layer (one compiled pass
    over the query-key grid, storing only per-tile flags): that keeps the seam's signature, so activation
    checkpointing (which rebuilds it) and pipeline stages need nothing more than this module.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if document_ids is None:
            return super().forward(q, k, v, positions)
        return flex_document_attention(q, k, v, document_block_mask(positions, positions, document_ids, document_ids))


def use_flex_document_attention(model: nn.Module) -> None:
    """Make every block of `model` (a decoder or pipeline stage) mask documents through FlexAttention, in place."""
    decoder = decoder_layout(model)
    for block in decoder.blocks_of(model).values():
        decoder.set_inner_attention(block, FlexDocumentAttention())
