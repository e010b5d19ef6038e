"""Training FLOPs per token of a pre-norm decoder (models/transformer.py), the numerator of MFU.

The PaLM/torchtitan convention, with causal attention counted once: 6 x the matmul parameters a token passes
through (attention and feed-forward projections, the output head even when tied; an MoE layer counts its router,
top-k experts and shared experts: ``models.moe.moe_params_per_token``) plus ``6 * n_layers * n_heads * head_dim
* seq_len`` for the attention scores and values (half the full square, since the mask leaves half). Embedding,
norms and RoPE are not matmuls; recomputation for activation checkpointing is not counted (MFU measures useful
work). ``masked_attention_flops_per_token`` is the half torchtitan also counts, so MFU figures can be put next to
its published ones (docs/training.md, "Metrics", "FLOPs per token").

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
