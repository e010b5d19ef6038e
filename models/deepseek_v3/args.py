"""Hyperparameters of the DeepSeek-V3 family (and DeepSeek-V2's shapes) and its size presets (flavors).

A DeepSeek decoder differs from Llama's in two places. Attention is multi-head latent attention (MLA): keys and
values are projected up from one small per-token latent (``kv_lora_rank``), queries optionally too
(``q_lora_rank``; 0 projects them directly), and only ``qk_rope_head_dim`` features of each query and key head are
rotated, the key's shared by all heads. The feed-forward of the first ``n_dense_layers`` blocks is a dense SwiGLU,
that of all later blocks a mixture of experts (``moe``, models/moe.py, from the ``moe_*`` fields).

The flavors torchtitan 0.2.2 defines (``debugmodel``, ``debugmodel_flex_attn``, ``16B`` = DeepSeek-V2-Lite's shape,
``236B`` = DeepSeek-V2's, ``671B`` = DeepSeek-V3's) are its settings field for field
(tests/reference/test_torchtitan_flavors.py), including where they depart from the published checkpoints: norm eps
1e-5 in every norm but the final one (eps of the activations' dtype), YaRN only once a run is longer than its
4096-token original context, loss-free balancing by an expert bias on every MoE. A Hugging Face config.json
(hf_adapter.py) gives the published settings instead. ``debugmodel_small`` is dtrain's own: smaller heads and
DeepSeek-V3's routing (sigmoid, groups, bias) on a CPU.
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
    one and the run's config.toml records them (dtrain/run/model_args.py handles scalars only); ``moe`` assembles them
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
    # eps of the block norms (and, without final_norm_dtype_eps, of the final norm).
    norm_eps: float = 1e-6
    # eps of the query and kv latent norms: DeepSeek's and Hugging Face's code fix it at 1e-6, torchtitan's is norm_eps.
    latent_norm_eps: float = 1e-6
    # The final norm's eps is the machine epsilon of the activations' dtype (1.2e-7 in float32, 7.8e-3 in bfloat16),
    # as torchtitan 0.2.2 builds that norm (without one); false: norm_eps, as Hugging Face's.
    final_norm_dtype_eps: bool = False
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    # Apply rope_scaling (frequencies and softmax scale) only when max_seq_len exceeds its original context, as
    # torchtitan 0.2.2 does (its runs set max_seq_len to training.seq_len); false: at every length, as Hugging Face.
    rope_scaling_beyond_original_only: bool = False
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
    def active_rope_scaling(self) -> YarnScaling | None:
        """The YaRN settings this model computes with at its max_seq_len (None: plain RoPE)."""
        scaling = self.rope_scaling
        if scaling is not None and self.rope_scaling_beyond_original_only:
            if self.max_seq_len <= scaling.original_max_position_embeddings:
                return None
        return scaling

    @property
    def qk_head_dim(self) -> int:
        """Features per query and key head: the position-free ones, then the rotated ones."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # DecoderArgs (models/decoder.py): the sizes the inner attention and the dense matmuls see, from MLA's fields.
    @property
    def head_dim(self) -> int:
        """Features per query and key head that the inner attention receives: ``qk_head_dim`` (model.py pads the
        values to it)."""
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


# torchtitan 0.2.2's YaRN: 40 times a 4096-token context, mscale on the softmax scale only (mscale == mscale_all_dim
# leaves the cos/sin table unscaled: yarn.py), applied once max_seq_len exceeds 4096 (torchtitan's
# update_from_config sets max_seq_len to training.seq_len; dtrain raises the flavor's 4096 to it).
def _torchtitan_yarn(mscale: float) -> YarnScaling:
    return YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=mscale, mscale_all_dim=mscale)


def _torchtitan(**fields) -> DeepSeekV3Args:
    """A torchtitan 0.2.2 flavor: its norm eps everywhere but the final norm, its YaRN rule, and its MoE's
    loss-free balancing (MoEArgs.load_balance_coeff 1e-3, which its DeepSeek-V3 optimizers apply every step)."""
    defaults = dict(
        norm_eps=1e-5, latent_norm_eps=1e-5, final_norm_dtype_eps=True, rope_scaling=_torchtitan_yarn(1.0),
        rope_scaling_beyond_original_only=True, max_seq_len=4096, moe_load_balance_bias=True,
        moe_bias_update_speed=1e-3, moe_aux_loss_coeff=0.0,
    )
    return DeepSeekV3Args(**{**defaults, **fields})


# torchtitan's small shape: full-size heads (kv latent 512, 128 + 64 query/key features), DeepSeek-V2's routing
# (softmax over 8 experts, 3 per token, 2 shared experts, no renormalisation).
_TORCHTITAN_DEBUG = dict(
    dim=256, n_layers=6, n_dense_layers=1, hidden_dim=1024, n_heads=16, q_lora_rank=0, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=2048, rope_scaling=_torchtitan_yarn(0.70),
    moe_num_experts=8, moe_top_k=3, moe_hidden_dim=256, moe_num_shared_experts=2, moe_score_func="softmax",
)

DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    "debugmodel": _torchtitan(**_TORCHTITAN_DEBUG),
    # The same model: its flex attention computes the same function, and its block-causal mask is dtrain's
    # document masking (training.attention_mask), a setting of the run.
    "debugmodel_flex_attn": _torchtitan(**_TORCHTITAN_DEBUG),
    # dtrain's CPU shape with every path of the 671B's MoE on: small heads, 8 experts in 4 groups, 2 groups per
    # token, sigmoid scores renormalised, a shared expert, loss-free balancing; plain RoPE.
    "debugmodel_small": DeepSeekV3Args(
        dim=256, n_layers=6, n_dense_layers=1, hidden_dim=1024, n_heads=16, q_lora_rank=0, kv_lora_rank=128,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, vocab_size=2048, moe_num_experts=8, moe_top_k=3,
        moe_hidden_dim=256, moe_num_shared_experts=1, moe_num_expert_groups=4, moe_num_limited_groups=2,
        moe_score_func="sigmoid", moe_route_norm=True, moe_load_balance_bias=True,
    ),
    # DeepSeek-V2-Lite's shape (15.7B parameters, 2.4B active per token): softmax routing over 64 experts.
    "16B": _torchtitan(
        dim=2048, n_layers=27, n_dense_layers=1, hidden_dim=10944, n_heads=16, q_lora_rank=0, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=102400,
        rope_scaling=_torchtitan_yarn(0.70), moe_num_experts=64, moe_top_k=6, moe_hidden_dim=1408,
        moe_num_shared_experts=2, moe_score_func="softmax",
    ),
    # DeepSeek-V2's shape (236B parameters, 21B active): softmax routing over 160 experts in 8 groups, 3 per token.
    "236B": _torchtitan(
        dim=5120, n_layers=60, n_dense_layers=1, hidden_dim=12288, n_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=102400, moe_num_experts=160,
        moe_top_k=6, moe_hidden_dim=1536, moe_num_shared_experts=2, moe_score_func="softmax", moe_route_scale=16.0,
        moe_num_expert_groups=8, moe_num_limited_groups=3,
    ),
    # DeepSeek-V3 (R1 and V3.1 share the shape): 671B parameters, 37B active per token (its multi-token
    # prediction module is not part of this model); sigmoid scores, group-limited, renormalised and scaled.
    "671B": _torchtitan(
        dim=7168, n_layers=61, n_dense_layers=3, hidden_dim=18432, n_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, moe_num_experts=256,
        moe_top_k=8, moe_hidden_dim=2048, moe_num_shared_experts=1, moe_score_func="sigmoid", moe_route_norm=True,
        moe_route_scale=2.5, moe_num_expert_groups=8, moe_num_limited_groups=4,
    ),
}
