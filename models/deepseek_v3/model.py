"""The DeepSeek-V3 transformer in plain single-device PyTorch: multi-head latent attention (MLA) and a
mixture-of-experts feed-forward after the first dense blocks.

Parameter names are torchtitan's (docs/models.md, "Parameter names"), and initialisation is the shared
decoder's (models/transformer.py). The model keeps the decoder protocol (``dtrain.models.decoder``) and the
attention seam (``dtrain.models.attention``), so the shared parallelize code treats its blocks like the others:
attention takes ``(x, rope_cache, positions, document_ids=None)``, derives its number of heads from the
projected tensors, and hands the inner attention whole per-head queries, keys and values. MLA is fitted to that
seam by zero-padding the values to ``qk_head_dim`` and by folding YaRN's ``mscale**2`` into the queries
(docs/models.md, "DeepSeek-V3: MLA on the shared seams").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import CausalSDPA
from ..layers import BASE_INIT_STD, RMSNorm, trunc_normal_init_
from ..rope import apply_rotary_emb, sequence_positions
from ..transformer import Transformer, TransformerBlock
from .args import DeepSeekV3Args
from .yarn import precompute_yarn_rope_cache, softmax_scale_factor


class SharedRopeKey(nn.Identity):
    """Where the rotated key, one per token and shared by all heads, enters the per-head computation.

    An identity here. Under tensor parallel each rank uses it for its own heads only, so its gradient is a partial
    sum over the ranks; the plan (parallelize/deepseek_v3.py) attaches the all-reduce to this module.
    """


class MultiHeadLatentAttention(nn.Module):
    """MLA: queries (directly, or through a normed low-rank latent) and a normed per-token kv latent projected up to
    every head's key and value; RoPE on the last ``qk_rope_head_dim`` features of each query head and on one key
    part shared by all heads; then the inner attention and the output projection."""

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__()
        self.qk_nope_head_dim, self.qk_rope_head_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.qk_head_dim, self.v_head_dim = args.qk_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        q_out = args.n_heads * args.qk_head_dim
        if args.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, eps=args.latent_norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, eps=args.latent_norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.shared_rope_key = SharedRopeKey()
        self.inner_attention = CausalSDPA()
        self.query_scale = softmax_scale_factor(args.active_rope_scaling)

    @property
    def low_rank_query(self) -> bool:
        return hasattr(self, "wq_a")

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        if positions is None:
            positions = sequence_positions(seqlen, rope_cache)
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.low_rank_query else self.wq(x)
        # -1, not n_heads: under tensor parallelism this rank's projections hold only its share of the heads.
        q_nope, q_rope = q.view(bsz, seqlen, -1, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1
        )
        q = torch.cat([q_nope, apply_rotary_emb(q_rope, rope_cache, positions)], dim=-1)

        kv_latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rope = self.shared_rope_key(apply_rotary_emb(k_rope.unsqueeze(2), rope_cache, positions))
        kv = self.wkv_b(self.kv_norm(kv_latent)).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        n_heads = k_nope.shape[2]
        k = torch.cat([k_nope, k_rope.expand(-1, -1, n_heads, -1)], dim=-1)

        if self.query_scale != 1.0:
            q = q * self.query_scale
        if self.v_head_dim < self.qk_head_dim:
            v = F.pad(v, (0, self.qk_head_dim - self.v_head_dim))
        out = self.inner_attention(q, k, v, positions, document_ids)[..., : self.v_head_dim]
        return self.wo(out.reshape(bsz, seqlen, -1))

    def init_weights(self, out_std: float) -> None:
        projections = (self.wq_a, self.wq_b) if self.low_rank_query else (self.wq,)
        for linear in (*projections, self.wkv_a, self.wkv_b):
            trunc_normal_init_(linear.weight, BASE_INIT_STD)
        for norm in (self.q_norm, self.kv_norm) if self.low_rank_query else (self.kv_norm,):
            norm.reset_parameters()
        trunc_normal_init_(self.wo.weight, out_std)


class DeepSeekV3Transformer(Transformer):
    """DeepSeek-V3: the shared decoder (models/transformer.py) whose blocks use multi-head latent attention, with
    the dense feed-forward in the first ``n_dense_layers`` blocks and the MoE layer after them, and YaRN RoPE on the
    decoupled rope part of queries and keys."""

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__(args)
        if args.final_norm_dtype_eps:
            self.norm.eps = None  # RMSNorm then takes the machine epsilon of its input's dtype

    def build_block(self, layer_id: int, args: DeepSeekV3Args) -> TransformerBlock:
        return TransformerBlock(
            layer_id, args, MultiHeadLatentAttention(args), use_moe=layer_id >= args.n_dense_layers
        )

    def rope_table(self, device: torch.device | str) -> torch.Tensor:
        args = self.args
        return precompute_yarn_rope_cache(
            args.qk_rope_head_dim, args.max_seq_len, args.rope_theta, args.active_rope_scaling, device
        )
