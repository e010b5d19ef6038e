"""Hyperparameters of the DeepSeek-V3 family (and DeepSeek-V2-Lite's shape) and its size presets (flavors).

A DeepSeek decoder differs from Llama's in two places. Attention is multi-head latent attention (MLA): keys and
values are projected up from one small per-token latent (``kv_lora_rank``), queries optionally too
(``q_lora_rank``; 0 projects them directly), and only ``qk_rope_head_dim`` features of each query and key head are
rotated, the key's shared by all heads. The feed-forward of the first ``n_dense_layers`` blocks is a dense SwiGLU,
that of all later blocks a mixture of experts (``moe``, models/moe.py, from the ``moe_*`` fields).

Flavor names and shapes are torchtitan's and the published models': ``16B`` is DeepSeek-V2-Lite (softmax routing
over 64 experts, no low-rank query), ``671B`` DeepSeek-V3 (sigmoid, group-limited routing with a load-balancing
bias). Both carry their published YaRN settings, which are applied at every length, as Hugging Face does, so that
their checkpoints compute the same function here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..moe import MoEArgs
from .yarn import YarnScaling

_POSITIVE = ("dim", "n_layers", "n_heads", "hidden_dim", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
             "v_head_dim", "vocab_size", "max_seq_len")


@dataclass
class DeepSeekV3Args:
    """Shape and numerics of a DeepSeek-V3 transformer. The defaults are the 16B (DeepSeek-V2-Lite) shape.

    The MoE settings are flat ``moe_*`` fields (as Qwen3-MoE's are) so that ``[model.args]`` overrides them one by
    one and the run's config.toml records them (dtrain/model_args.py handles scalars only); ``moe`` assembles them
    into the ``MoEArgs`` of models/moe.py, whose checks they pass at construction.
    """

    dim: int = 2048
    n_layers: int = 27
    # Blocks 0 .. n_dense_layers-1 have a dense feed-forward, the rest a MoE (HF first_k_dense_replace).
    n_dense_layers: int = 1
    # Width of the dense SwiGLU (HF intermediate_size); the experts' is moe_hidden_dim.
    hidden_dim: int = 10944
    n_heads: int = 16
    # Rank of the query's low-rank projection (wq_a, q_norm, wq_b); 0: one full projection wq.
    q_lora_rank: int = 0
    # Width of the latent that keys and values are projected up from (and that an inference cache would hold).
    kv_lora_rank: int = 512
    # Per head: query/key features without position, rotated features, value features.
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    vocab_size: int = 102400
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    # Longest sequence the RoPE table covers; the trainer sets it to at least its training seq_len.
    max_seq_len: int = 4096
    tie_word_embeddings: bool = False
    # Routed experts per MoE block (HF n_routed_experts) and how many each token is routed to (num_experts_per_tok).
    moe_num_experts: int = 64
    moe_top_k: int = 6
    # Each routed expert's SwiGLU width (HF moe_intermediate_size).
    moe_hidden_dim: int = 1408
    # Experts every token goes through, as one SwiGLU of moe_num_shared_experts * moe_hidden_dim (n_shared_experts).
    moe_num_shared_experts: int = 2
    # "softmax" (DeepSeek-V2) or "sigmoid" (V3) routing scores.
    moe_score_func: str = "softmax"
    # Renormalise a token's top-k scores to sum to 1 (HF norm_topk_prob), then scale them (routed_scaling_factor).
    moe_route_norm: bool = False
    moe_route_scale: float = 1.0
    # Group-limited routing: experts in moe_num_expert_groups groups, a token picks among its best
    # moe_num_limited_groups of them (HF n_group, topk_group).
    moe_num_expert_groups: int = 1
    moe_num_limited_groups: int = 1
    # Weight of each MoE block's auxiliary load-balancing loss; 0 turns it off.
    moe_aux_loss_coeff: float = 0.0
    # DeepSeek-V3's loss-free balancing: a per-expert bias on the selection scores (HF e_score_correction_bias),
    # moved by moe_bias_update_speed after each optimizer step.
    moe_load_balance_bias: bool = False
    moe_bias_update_speed: float = 1e-3

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise ValueError(f"DeepSeekV3Args.{name} must be > 0, got {getattr(self, name)}")
        if self.q_lora_rank < 0:
            raise ValueError(f"DeepSeekV3Args.q_lora_rank must be >= 0 (0: no low-rank query), got {self.q_lora_rank}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(
                f"DeepSeekV3Args.n_dense_layers must be in [0, n_layers={self.n_layers}], got {self.n_dense_layers}"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepSeekV3Args.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for RoPE")
        if self.v_head_dim > self.qk_head_dim:
            # Values are zero-padded to the query/key head size for the attention kernels (model.py).
            raise ValueError(
                f"DeepSeekV3Args.v_head_dim ({self.v_head_dim}) must be at most qk_nope_head_dim + qk_rope_head_dim "
                f"({self.qk_head_dim})"
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise ValueError(f"DeepSeekV3Args.rope_scaling must be a YarnScaling or None, got {self.rope_scaling!r}")
        try:
            self.moe  # builds the MoEArgs, which checks the moe_* fields
        except ValueError as err:
            # MoEArgs' messages start with the field's name, ours with moe_ in front of it.
            raise ValueError(f"DeepSeekV3Args.moe_{err}") from None

    @property
    def moe(self) -> MoEArgs:
        """The feed-forward of the blocks after the first n_dense_layers (models/moe.py)."""
        return MoEArgs(
            num_experts=self.moe_num_experts,
            top_k=self.moe_top_k,
            hidden_dim=self.moe_hidden_dim,
            num_shared_experts=self.moe_num_shared_experts,
            score_func=self.moe_score_func,
            route_norm=self.moe_route_norm,
            route_scale=self.moe_route_scale,
            num_expert_groups=self.moe_num_expert_groups,
            num_limited_groups=self.moe_num_limited_groups,
            aux_loss_coeff=self.moe_aux_loss_coeff,
            load_balance_bias=self.moe_load_balance_bias,
            bias_update_speed=self.moe_bias_update_speed,
        )

    @property
    def qk_head_dim(self) -> int:
        """Features per query and key head: the position-free ones, then the rotated ones."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """The query/key head size, as shared code (memory estimates) reads it; values are padded to it."""
        return self.qk_head_dim

    @property
    def n_kv_heads(self) -> int:
        """MLA projects every head's own key and value from the latent: as many as query heads, no grouping."""
        return self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """The dense feed-forward width, which tensor parallel splits (the experts' is split by expert parallel)."""
        return self.hidden_dim

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers


# The YaRN extension both published models were released with (128K from a 4K pretraining context).
_V2_LITE_YARN = YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707)
_V3_YARN = YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
# DeepSeek-V3's routing: sigmoid scores, a selection bias for loss-free balancing, group-limited choice,
# renormalised combine weights.
_V3_ROUTING = dict(moe_score_func="sigmoid", moe_route_norm=True, moe_load_balance_bias=True)

DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    # Small enough for a CPU, with every path of the 671B's MoE on: 8 experts in 4 groups, 2 groups per token.
    "debugmodel": DeepSeekV3Args(
        dim=256, n_layers=6, n_dense_layers=1, hidden_dim=1024, n_heads=16, q_lora_rank=0, kv_lora_rank=128,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, vocab_size=2048, moe_num_experts=8, moe_top_k=3,
        moe_hidden_dim=256, moe_num_shared_experts=1, moe_num_expert_groups=4, moe_num_limited_groups=2,
        **_V3_ROUTING,
    ),
    # DeepSeek-V2-Lite: 15.7B parameters, 2.4B active per token; softmax routing balanced by an auxiliary loss
    # (its paper's expert-level balance factor).
    "16B": DeepSeekV3Args(
        dim=2048, n_layers=27, n_dense_layers=1, hidden_dim=10944, n_heads=16, q_lora_rank=0, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=102400, rope_scaling=_V2_LITE_YARN,
        moe_num_experts=64, moe_top_k=6, moe_hidden_dim=1408, moe_num_shared_experts=2, moe_score_func="softmax",
        moe_aux_loss_coeff=0.001,
    ),
    # DeepSeek-V3 (R1 and V3.1 share the shape): 671B parameters, 37B active per token (its multi-token
    # prediction module is not part of this model).
    "671B": DeepSeekV3Args(
        dim=7168, n_layers=61, n_dense_layers=3, hidden_dim=18432, n_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, rope_scaling=_V3_YARN,
        moe_num_experts=256, moe_top_k=8, moe_hidden_dim=2048, moe_num_shared_experts=1, moe_route_scale=2.5,
        moe_num_expert_groups=8, moe_num_limited_groups=4, **_V3_ROUTING,
    ),
}
