"""Training FLOPs per token of a DeepSeek-V3 model, counting the parameters a token is computed with (active).

The convention of ``models/flops.py`` (6 FLOPs per matmul parameter and token for forward and backward, causal
attention counted once), with a mixture of experts counted by what one token passes through: the router, its
``top_k`` routed experts and the shared experts (``moe_params_per_token``), not all the experts a layer holds.
MLA's matmuls are its projections (the query's one or two, the kv latent's down and up, the output); its attention
computes scores over ``qk_head_dim`` features and sums ``v_head_dim`` value features (the zero padding of the
values, model.py, is not useful work), ``3 * n_heads * (qk_head_dim + v_head_dim) * seq_len`` per layer and token
under a causal mask. torchtitan counts the whole square instead (twice that).
"""

from __future__ import annotations

from ..moe import moe_params_per_token
from .args import DeepSeekV3Args


def attention_matmul_params(args: DeepSeekV3Args) -> int:
    """Parameters of one block's MLA projections."""
    q_out = args.n_heads * args.qk_head_dim
    query = args.dim * q_out if args.q_lora_rank == 0 else args.q_lora_rank * (args.dim + q_out)
    kv_down = args.dim * (args.kv_lora_rank + args.qk_rope_head_dim)
    kv_up = args.kv_lora_rank * args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)
    out = args.n_heads * args.v_head_dim * args.dim
    return query + kv_down + kv_up + out


def active_matmul_params(args: DeepSeekV3Args) -> int:
    """Matmul parameters one token is computed with: every block's attention, the dense blocks' feed-forward, the
    MoE blocks' active experts, and the output head (not the embedding, a lookup)."""
    dense_ffn = 3 * args.dim * args.hidden_dim
    return (
        args.n_layers * attention_matmul_params(args)
        + args.n_dense_layers * dense_ffn
        + args.n_moe_layers * moe_params_per_token(args.moe, args.dim)
        + args.dim * args.vocab_size
    )


def active_params(args: DeepSeekV3Args) -> int:
    """Parameters one token is computed with, counted as DeepSeek's published "activated parameters" are (2.4B
    for V2-Lite, 37B for V3): the active matmul weights and the norms; the embedding table, a lookup, is not."""
    norms = args.n_layers * (2 * args.dim + args.kv_lora_rank + args.q_lora_rank) + args.dim
    return active_matmul_params(args) + norms


def attention_flops_per_token(args: DeepSeekV3Args, seq_len: int) -> int:
    """Forward + backward FLOPs per token of the attention scores and weighted values, under a causal mask."""
    return 3 * args.n_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len


def num_flops_per_token(args: DeepSeekV3Args, seq_len: int) -> int:
    """Forward + backward FLOPs per trained token at sequence length ``seq_len`` (see the module docstring)."""
    return 6 * active_matmul_params(args) + attention_flops_per_token(args, seq_len)
