"""Training FLOPs per token of a pre-norm decoder (models/transformer.py), the numerator of MFU.

Convention (the PaLM/torchtitan one, with causal attention counted once):
- every weight matrix used in a matmul costs 2 FLOPs per token per parameter forward and 4 backward, so 6 x the
  matmul parameters: the blocks' attention and feed-forward projections and the output head (also when it is
  tied to the embedding, since it is still a matmul). The embedding lookup, norms (QK-norm too) and RoPE are not
  matmuls and are left out. A mixture-of-experts feed-forward counts only what a token passes through (its
  router gate, its top-k experts and any shared experts: ``models.moe.moe_params_per_token``), not every expert;
- attention scores (q k^T) and the weighted sum of values (p v) each cost 2 * n_heads * head_dim * seq_len FLOPs
  per token forward over the full square, so 12 * n_layers * n_heads * head_dim * seq_len for forward and
  backward. A causal mask leaves half of that square to compute, so we count 6 * n_layers * n_heads * head_dim *
  seq_len (for Llama 3, n_heads * head_dim = dim).
Recomputation for activation checkpointing is not counted: MFU measures useful work. torchtitan counts the whole
attention square instead (twice the attention term here); ``masked_attention_flops_per_token`` is the difference,
so that MFU figures can be put next to torchtitan's published ones.

Args are any family's ``DecoderArgs`` (models/decoder.py) whose blocks are the shared decoder's (every block
dense, or every block ``moe``, as models/transformer.py builds them).
"""

from __future__ import annotations

from .decoder import DecoderArgs
from .moe import moe_params_per_token


def matmul_params(args: DecoderArgs) -> int:
    """Parameters of the matmul weights a token passes through: the blocks' projections (of an MoE feed-forward,
    only the active ones) and the output head (not the embedding)."""
    q_and_o = 2 * args.dim * args.n_heads * args.head_dim
    k_and_v = 2 * args.dim * args.n_kv_heads * args.head_dim
    moe = args.moe
    feed_forward = 3 * args.dim * args.ffn_hidden_dim if moe is None else moe_params_per_token(moe, args.dim)
    return args.n_layers * (q_and_o + k_and_v + feed_forward) + args.dim * args.vocab_size


def num_flops_per_token(args: DecoderArgs, seq_len: int) -> int:
    """Forward + backward FLOPs per trained token at sequence length ``seq_len`` (see the module docstring)."""
    return 6 * matmul_params(args) + 6 * args.n_layers * args.n_heads * args.head_dim * seq_len


def masked_attention_flops_per_token(args: DecoderArgs, seq_len: int) -> int:
    """The attention FLOPs per token a causal mask skips, which torchtitan's MFU convention counts anyway."""
    return 6 * args.n_layers * args.n_heads * args.head_dim * seq_len
