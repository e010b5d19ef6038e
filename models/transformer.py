"""The pre-norm decoder of the Llama family in plain single-device PyTorch, shared by the families built like it.

Llama 3 is this model as it is; Qwen3 adds QK-norm (``qk_norm = True`` on its subclass: an RMSNorm over each
head's features of the queries and keys, before RoPE) and sets ``head_dim`` and the FFN width freely; Qwen3-MoE
replaces every block's feed-forward by a routed mixture of experts (``models/moe.py``). The args of a family
are ``TransformerArgs``: the shared ``DecoderArgs`` (``moe`` None: dense), ``norm_eps``, ``rope_theta``, and the
``rope_scaling`` that ``rope_table`` reads. Norms, the feed-forward and the init rules are models/layers.py's.

Parameter names are torchtitan's, so checkpoints move between the two projects (docs/models.md, "Parameter
names"); initialisation is torchtitan 0.2.2's, distribution for distribution (docs/models.md, "Initialisation").
Parallelism is applied from outside (``dtrain.parallelize``): attention derives its number of heads from the
projected tensors (a TP rank holds a slice of them), the model keeps the decoder protocol
(``dtrain.models.decoder``: a pipeline stage is this model with parts removed), and every block initialises
itself, so a stage initialises only what it holds (docs/models.md, "What a family is").
"""

from __future__ import annotations

from typing import Callable, ClassVar, Protocol

import torch
from torch import nn

from .attention import CausalSDPA
from .decoder import DecoderArgs, DecoderLayout
from .layers import BASE_INIT_STD, FeedForward, RMSNorm, depth_scaled_init_std, head_init_, trunc_normal_init_
from .moe import MoE
from .rope import apply_rotary_emb, precompute_rope_cache, sequence_positions


class TransformerArgs(DecoderArgs, Protocol):
    """What this decoder reads of its args besides the shared ``DecoderArgs`` (``rope_table`` also reads the
    family's ``rope_scaling``; a family with another RoPE overrides it)."""

    @property
    def norm_eps(self) -> float: ...

    @property
    def rope_theta(self) -> float: ...


class Attention(nn.Module):
    """Grouped-query self-attention: projections, RoPE on queries and keys at their positions, then the inner
    attention (``dtrain.models.attention``; causal SDPA unless a plan swaps it), then the output projection.

    With ``qk_norm``, queries and keys are RMS-normalised per head (one weight of ``head_dim`` shared by all heads)
    right after their projection, before RoPE, as Qwen3 does.
    """

    def __init__(self, args: TransformerArgs, qk_norm: bool = False) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps) if qk_norm else None
        self.inner_attention = CausalSDPA()

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
        # -1, not n_heads: under tensor parallelism this rank's projections hold only its share of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary_emb(q, rope_cache, positions)
        k = apply_rotary_emb(k, rope_cache, positions)
        out = self.inner_attention(q, k, v, positions, document_ids)
        return self.wo(out.reshape(bsz, seqlen, -1))

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_init_(linear.weight, BASE_INIT_STD)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()
        trunc_normal_init_(self.wo.weight, out_std)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attention(norm(x))``, ``out = h + feed_forward(norm(h))``, where the
    feed-forward is ``self.moe`` (routed experts, ``args.moe``) when `use_moe`, else the dense
    ``self.feed_forward``; the other attribute is None. `attention` is any module with the shared attention's
    signature and ``init_weights(out_std)`` (grouped-query attention here, DeepSeek-V3's latent attention)."""

    def __init__(self, layer_id: int, args: TransformerArgs, attention: nn.Module, use_moe: bool = False) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = attention
        self.feed_forward = None if use_moe else FeedForward(args.dim, args.ffn_hidden_dim)
        self.moe = MoE(args.moe, args.dim) if use_moe else None
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # document_ids stays positional: plans rewrite attention's positional inputs (context parallel's positions
        # hook, tensor parallel's input layouts) and must see it in its place.
        h = x + self.attention(self.attention_norm(x), rope_cache, positions, document_ids)
        feed_forward = self.moe if self.moe is not None else self.feed_forward
        return h + feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        out_std = depth_scaled_init_std(self.layer_id)
        self.attention.init_weights(out_std)
        if self.moe is not None:
            self.moe.init_weights(BASE_INIT_STD, out_std)
        else:
            self.feed_forward.init_weights(out_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class Transformer(nn.Module):
    """Llama 3 (and, with QK-norm, Qwen3): ``tokens [B, S] -> logits [B, S, vocab]`` (the loss lives outside).

    A pipeline stage is this model with some of ``layers`` deleted and ``tok_embeddings``, ``norm`` or ``output``
    set to None: the forward passes through what exists, so a middle stage maps hidden states to hidden states.
    Built on a real device it comes initialised; built on ``meta``, call ``to_empty`` then ``init_weights``.
    """

    decoder_layout: ClassVar[DecoderLayout] = DecoderLayout(
        embedding="tok_embeddings",
        blocks="layers",
        final_norm="norm",
        head="output",
        attention="attention",
        inner_attention="inner_attention",
    )
    # Subclasses of a family with QK-norm (Qwen3) set this.
    qk_norm: ClassVar[bool] = False

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.build_block(i, args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: it is a function of the args, never read from a checkpoint. The placeholder only fixes
        # the device; init_weights computes the table there.
        self.register_buffer("rope_cache", torch.empty(0), persistent=False)
        self.init_weights()

    def build_block(self, layer_id: int, args: TransformerArgs) -> TransformerBlock:
        """Block `layer_id`: grouped-query attention (with QK-norm where the family has it), and the MoE
        feed-forward in every block when the args have ``moe`` (Qwen3-MoE). Other families override this."""
        use_moe = args.moe is not None
        return TransformerBlock(layer_id, args, Attention(args, self.qk_norm), use_moe=use_moe)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits (or, for a stage without the head, hidden states) of ``tokens [B, S]`` (or hidden states).

        ``positions [S]`` are the tokens' positions in their sequence, for RoPE and the inner attention; a
        context-parallel rank, which holds only some chunks of each sequence, passes theirs. None means a whole
        sequence: each attention then takes ``0 .. S-1`` over the sequence it sees (under sequence parallel the
        gathered one, though a pipeline stage receives only its shard of the hidden states).

        ``document_ids [B, S]``, the document of each token in its packed window, makes attention causal within
        each document only (``dtrain.models.attention``); RoPE still takes the positions in the window. None is
        causal attention over the whole window.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, positions, document_ids)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise every parameter this model (or stage) holds and recompute the RoPE table.

        ``buffer_device`` places the RoPE table (default: where it is now), e.g. on the GPU while the
        parameters are offloaded to the CPU.
        """
        args = self.args
        self.init_buffers(buffer_device)
        with torch.no_grad():
            if self.tok_embeddings is not None and not args.tie_word_embeddings:
                nn.init.normal_(self.tok_embeddings.weight)
            for layer in self.layers.values():
                layer.init_weights()
            if self.norm is not None:
                self.norm.reset_parameters()
            if self.output is not None:
                head_init_(self.output.weight, args.dim)
            elif args.tie_word_embeddings and self.tok_embeddings is not None:
                # A stage that holds the tied embedding without the head: the weight is still the head's.
                head_init_(self.tok_embeddings.weight, args.dim)

    def init_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        """Compute the buffers that no checkpoint holds, on ``buffer_device`` (default: where they are now): the RoPE
        table, a function of the args, and MoE layers' token counts; what a model needs besides loaded weights."""
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = self.rope_table(device)
        with torch.no_grad():
            for layer in self.layers.values():
                if layer.moe is not None:
                    # Counts since the last step, which start at zero (after to_empty they hold stale memory).
                    layer.moe.tokens_per_expert.zero_()

    def rope_table(self, device: torch.device | str) -> torch.Tensor:
        """The RoPE table of this model's args on `device` (a family with another RoPE overrides it)."""
        args = self.args
        return precompute_rope_cache(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling, device)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Transformer:
        # Converting parameters one module at a time (to_empty, and .to() across incompatible devices) gives the
        # embedding and the head separate new tensors; restore the tie so they stay one parameter.
        super()._apply(fn, recurse)
        if self.args.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            if self.output.weight is not self.tok_embeddings.weight:
                self.output.weight = self.tok_embeddings.weight
        return self
