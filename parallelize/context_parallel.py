"""Context parallel: every sequence of a batch is split over the ``cp`` ranks, and attention sees all of it.

Each CP rank holds ``seq_len / cp`` tokens of every sequence (head-tail chunks by default, for equal causal work).
Everything but attention is per token, so three things change, all from outside the model: the batch
(``shard_sequence`` keeps this rank's tokens, labels and document ids), the positions (a forward pre-hook gives
each attention its tokens' true positions, for RoPE), and each block's inner attention, replaced by one that sees
the whole sequence's keys along ``cp_attention_path``: ``ring`` (torch's ring attention, CUDA, causal),
``blockwise`` (all-gathered kv heads and the CPU flash kernel chunk by chunk: torch's ring has no CPU rule),
``masked`` (the same all-gather, then SDPA with a position/document mask) or ``flex`` (the same all-gather, then a
FlexAttention block mask, CUDA). The paths, what each keeps for backward and where each was verified:
docs/parallelism.md, "Context parallel".
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtrain.models.attention import repeat_kv
from dtrain.models.decoder import decoder_layout
from dtrain.models.flex_attention import document_block_mask, flex_document_attention
from dtrain.parallelize.blockwise_attention import BlockCausalAttention
from dtrain.parallelize.ring_attention import RingAttention
from dtrain.parallelize.torch_compat import all_gather_autograd

LOAD_BALANCERS = ("headtail", "none")


def chunk_blocks(cp_rank: int, cp: int, load_balancer: str) -> tuple[int, ...]:
    """Which of the sequence's equal blocks cp rank `cp_rank` holds, in its order: ``i`` and ``2 cp - 1 - i`` of
    ``2 cp`` under head-tail, ``i`` of ``cp`` otherwise."""
    return (cp_rank, 2 * cp - 1 - cp_rank) if load_balancer == "headtail" else (cp_rank,)


def chunk_positions(seq_len: int, cp_rank: int, cp: int, load_balancer: str, device=None) -> torch.Tensor:
    """Positions, in the whole sequence of `seq_len` tokens, of the ``seq_len / cp`` tokens cp rank `cp_rank` holds.

    Built on each call rather than cached: a few small aranges, which torch.compile traces inside a block.
    """
    blocks = chunk_blocks(cp_rank, cp, load_balancer)
    size = seq_len // (cp * len(blocks))
    return torch.cat([torch.arange(b * size, (b + 1) * size, device=device) for b in blocks])


def gathered_positions(local_len: int, cp: int, load_balancer: str, device) -> torch.Tensor:
    """Positions of the gathered keys: every rank's chunks, in rank order (the all-gather's order)."""
    return torch.cat([chunk_positions(local_len * cp, r, cp, load_balancer, device) for r in range(cp)])


def in_position_order(x: torch.Tensor, cp: int, load_balancer: str) -> torch.Tensor:
    """``[b, seq, ...]`` gathered in rank order (every rank's blocks, as ``chunk_blocks`` lists them) put back in
    position order."""
    gathered = [b for rank in range(cp) for b in chunk_blocks(rank, cp, load_balancer)]
    order = [gathered.index(block) for block in range(len(gathered))]
    blocks = x.unflatten(1, (len(gathered), x.shape[1] // len(gathered)))
    return blocks[:, order].flatten(1, 2)


def shard_sequence(
    batch: dict[str, torch.Tensor], cp_rank: int, cp: int, load_balancer: str
) -> dict[str, torch.Tensor]:
    """This cp rank's tokens of every ``[batch, seq]`` tensor of `batch` (the same positions in each)."""
    seq_len = batch["input_ids"].shape[1]
    index = chunk_positions(seq_len, cp_rank, cp, load_balancer, batch["input_ids"].device)
    return {key: value.index_select(1, index) for key, value in batch.items()}


def cp_attention_path(device_type: str, attention_mask: str, flex: bool = False) -> str:
    """The attention a cp rank runs (see the module doc): ``ring``, ``blockwise``, ``masked`` or ``flex`` (document
    masking through FlexAttention)."""
    if attention_mask != "causal":
        return "flex" if flex else "masked"
    return {"cuda": "ring", "cpu": "blockwise"}.get(device_type, "masked")


class AllGatherKVAttention(nn.Module):
    """Grouped-query attention of this rank's queries over the whole sequence's keys and values, gathered over cp,
    on `path`: chunk by chunk with the CPU kernel (``blockwise``, causal mask only), with a dense mask
    (``masked``) or, for documents, a FlexAttention block mask (``flex``)."""

    def __init__(self, cp_mesh: DeviceMesh, load_balancer: str, path: str):
        super().__init__()
        self.cp_mesh = cp_mesh
        self.load_balancer = load_balancer
        self.path = path

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cp = self.cp_mesh.size()
        k = all_gather_autograd(k.contiguous(), gather_dim=1, group=self.cp_mesh)
        v = all_gather_autograd(v.contiguous(), gather_dim=1, group=self.cp_mesh)
        if self.path == "blockwise":
            blocks = chunk_blocks(self.cp_mesh.get_local_rank(), cp, self.load_balancer)
            k, v = in_position_order(k, cp, self.load_balancer), in_position_order(v, cp, self.load_balancer)
            out = BlockCausalAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), blocks)
            return out.transpose(1, 2)
        key_positions = gathered_positions(q.shape[1], cp, self.load_balancer, q.device)
        if document_ids is None:
            return masked_attention(q, k, v, positions[:, None] >= key_positions[None, :])
        key_documents = funcol.all_gather_tensor(document_ids.contiguous(), gather_dim=1, group=self.cp_mesh)
        if self.path == "flex":
            block_mask = document_block_mask(positions, key_positions, document_ids, key_documents)
            return flex_document_attention(q, k, v, block_mask)
        allowed = positions[:, None] >= key_positions[None, :]
        allowed = allowed & (document_ids[:, :, None] == key_documents[:, None, :])
        return masked_attention(q, k, v, allowed)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Queries ``[b, s_q, heads, d]`` over keys ``[b, s_k, kv_heads, d]`` where `allowed` ``[(b,) s_q, s_k]`` is
    true: exact for any order and mask, but the mask is kept for backward (``s_q s_k`` bytes per layer)."""
    n_rep = q.shape[2] // k.shape[2]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    if allowed.dim() == 3:  # one mask per sequence, shared by the heads
        allowed = allowed[:, None]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed)
    return out.transpose(1, 2)


def cp_attention(cp_mesh: DeviceMesh, load_balancer: str, rotate_method: str, path: str) -> nn.Module:
    """The inner attention of one block under context parallel, on `path` (``cp_attention_path``)."""
    if path == "ring":
        return RingAttention(cp_mesh, load_balancer, rotate_method)
    return AllGatherKVAttention(cp_mesh, load_balancer, path)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, load_balancer: str, rotate_method: str, path: str) -> None:
    """Make every block of `model` (a decoder or pipeline stage) attend across the cp ranks' chunks, in place (see
    the module doc)."""
    cp_rank, cp = cp_mesh.get_local_rank(), cp_mesh.size()
    decoder = decoder_layout(model)

    def global_positions(attention: nn.Module, args: tuple) -> tuple:
        x, rope_cache = args[0], args[1]
        positions = chunk_positions(x.shape[1] * cp, cp_rank, cp, load_balancer, rope_cache.device)
        return (x, rope_cache, positions, *args[3:])

    for block in decoder.blocks_of(model).values():
        decoder.set_inner_attention(block, cp_attention(cp_mesh, load_balancer, rotate_method, path))
        decoder.attention_of(block).register_forward_pre_hook(global_positions)
