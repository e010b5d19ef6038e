"""Hyperparameters of the Qwen3 family, dense and mixture-of-experts (Qwen3-MoE), and its published size presets
(flavors).

Unlike Llama 3, the head size is its own field (``n_heads * head_dim`` need not equal ``dim``), the FFN width is
given directly, queries and keys are RMS-normalised per head (QK-norm), RoPE has no frequency scaling, and the
small models tie the embedding to the head. Every flavor name torchtitan 0.2.2 defines is its model, field for field
(tests/reference/test_torchtitan_flavors.py); ``debugmodel_moe_small`` is dtrain's own.

Qwen3-MoE is the same decoder whose every feed-forward is a routed mixture of SwiGLU experts (``models/moe.py``:
softmax scores, top-k, optionally renormalised, no shared experts). Its settings are flat ``moe_*`` fields rather
than a nested dataclass so that ``[model.args]`` overrides them one by one and the run's config.toml records them
like any other field (dtrain/run/model_args.py handles scalars only); ``Qwen3Args.moe`` assembles them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..moe import MoEArgs

# What an MoE model (moe_num_experts > 0) takes for a routing setting left unset: Qwen3-30B-A3B's config.json.
QWEN3_MOE_DEFAULTS = {
    "moe_top_k": 8,
    "moe_hidden_dim": 768,
    "moe_route_norm": True,
    "moe_aux_loss_coeff": 0.001,
    "moe_load_balance_bias": False,
}


@dataclass
class Qwen3Args:
    """Shape and numerics of a Qwen3 transformer. The defaults are Qwen3-8B."""

    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    # Width of the dense SwiGLU feed-forward (HF's intermediate_size). An MoE model has none and keeps this only
    # for its config.json.
    hidden_dim: int = 12288
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    # Longest sequence the RoPE tables cover; the trainer sets it to at least its training seq_len.
    max_seq_len: int = 4096
    tie_word_embeddings: bool = False
    # Routed experts per block (HF num_experts); 0 is the dense model.
    moe_num_experts: int = 0
    # The MoE settings below are unset (none) on a dense model; an MoE model fills those left unset from
    # QWEN3_MOE_DEFAULTS, so that what it runs with is what the run's config.toml records.
    # Experts each token is routed to (HF num_experts_per_tok).
    moe_top_k: int | None = None
    # Each expert's SwiGLU width (HF moe_intermediate_size).
    moe_hidden_dim: int | None = None
    # Renormalise a token's top-k routing scores to sum to 1 (HF norm_topk_prob).
    moe_route_norm: bool | None = None
    # Weight of each block's load-balancing loss (HF router_aux_loss_coef); 0 turns it off.
    moe_aux_loss_coeff: float | None = None
    # Balance the load without a loss, by a per-expert bias on the selection scores (DeepSeek-V3's; not in HF).
    moe_load_balance_bias: bool | None = None

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Qwen3Args.{name} must be > 0, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"Qwen3Args.n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Args.head_dim ({self.head_dim}) must be even for RoPE")
        if self.moe_num_experts < 0:
            raise ValueError(f"Qwen3Args.moe_num_experts must be >= 0 (0: dense), got {self.moe_num_experts}")
        if self.moe_num_experts:
            self._resolve_moe()

    def _resolve_moe(self) -> None:
        """Fill the unset MoE settings, then check them."""
        for name, default in QWEN3_MOE_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        if not 1 <= self.moe_top_k <= self.moe_num_experts:
            raise ValueError(
                f"Qwen3Args.moe_top_k must be in [1, moe_num_experts={self.moe_num_experts}], got {self.moe_top_k}"
            )
        if self.moe_hidden_dim <= 0:
            raise ValueError(f"Qwen3Args.moe_hidden_dim must be > 0, got {self.moe_hidden_dim}")
        if self.moe_aux_loss_coeff < 0:
            raise ValueError(f"Qwen3Args.moe_aux_loss_coeff must be >= 0, got {self.moe_aux_loss_coeff}")

    @property
    def moe(self) -> MoEArgs | None:
        """The routed feed-forward of every block (models/moe.py), or None for the dense model."""
        if not self.moe_num_experts:
            return None
        return MoEArgs(
            num_experts=self.moe_num_experts,
            top_k=self.moe_top_k,
            hidden_dim=self.moe_hidden_dim,
            num_shared_experts=0,
            score_func="softmax",
            route_norm=self.moe_route_norm,
            aux_loss_coeff=self.moe_aux_loss_coeff,
            load_balance_bias=self.moe_load_balance_bias,
        )

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim

    @property
    def rope_scaling(self) -> None:
        """Qwen3 uses plain RoPE (the shared model reads this field)."""
        return None


def _qwen3(dim: int, n_layers: int, n_heads: int, hidden_dim: int, tie: bool, vocab_size: int = 151936) -> Qwen3Args:
    return Qwen3Args(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, head_dim=128, hidden_dim=hidden_dim,
        vocab_size=vocab_size, tie_word_embeddings=tie,
    )


def _qwen3_moe(
    dim: int, n_layers: int, n_heads: int, n_kv_heads: int, hidden_dim: int, num_experts: int, top_k: int,
    moe_hidden_dim: int, tie: bool = False, vocab_size: int = 151936, rope_theta: float = 1000000.0,
    aux_loss_coeff: float = 0.0,
) -> Qwen3Args:
    """A Qwen3-MoE shape: every block routes to ``top_k`` of ``num_experts`` experts, scores renormalised.

    torchtitan 0.2.2 trains these without any load balancing: no auxiliary loss, and the expert bias its MoE layer
    holds (MoEArgs.load_balance_coeff's default) is never updated by its Qwen3 optimizers, so it stays zero and
    routes as none (its checkpoints carry that zero ``expert_bias``; ours have none)."""
    return Qwen3Args(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=128, hidden_dim=hidden_dim,
        vocab_size=vocab_size, rope_theta=rope_theta, tie_word_embeddings=tie, moe_num_experts=num_experts,
        moe_top_k=top_k, moe_hidden_dim=moe_hidden_dim, moe_route_norm=True, moe_aux_loss_coeff=aux_loss_coeff,
        moe_load_balance_bias=False,
    )


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    # torchtitan's debug shape: small enough for a CPU, with head_dim (128) independent of dim (256).
    "debugmodel": _qwen3(dim=256, n_layers=8, n_heads=16, hidden_dim=3072, tie=True, vocab_size=2048),
    "0.6B": _qwen3(dim=1024, n_layers=28, n_heads=16, hidden_dim=3072, tie=True),
    "1.7B": _qwen3(dim=2048, n_layers=28, n_heads=16, hidden_dim=6144, tie=True),
    "4B": _qwen3(dim=2560, n_layers=36, n_heads=32, hidden_dim=9728, tie=True),
    "8B": _qwen3(dim=4096, n_layers=36, n_heads=32, hidden_dim=12288, tie=False),
    "14B": _qwen3(dim=5120, n_layers=40, n_heads=40, hidden_dim=17408, tie=False),
    "32B": _qwen3(dim=5120, n_layers=64, n_heads=64, hidden_dim=25600, tie=False),
    # torchtitan's debug MoE: the debug shape, untied, with 64 experts of width 768, 8 per token (300M parameters).
    "debugmodel_moe": _qwen3_moe(dim=256, n_layers=8, n_heads=16, n_kv_heads=8, hidden_dim=3072, num_experts=64,
                                 top_k=8, moe_hidden_dim=768, vocab_size=2048),
    # dtrain's MoE for a CPU: 16 narrow experts, 4 per token, tied, with HF's auxiliary loss (router_aux_loss_coef).
    # 16 experts split evenly over expert-parallel degrees 1, 2, 4, 8 and 16.
    "debugmodel_moe_small": _qwen3_moe(dim=256, n_layers=8, n_heads=16, n_kv_heads=8, hidden_dim=3072,
                                       num_experts=16, top_k=4, moe_hidden_dim=128, tie=True, vocab_size=2048,
                                       aux_loss_coeff=0.001),
    "30B-A3B": _qwen3_moe(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, hidden_dim=6144, num_experts=128,
                          top_k=8, moe_hidden_dim=768),
    # RoPE theta 5e6 is torchtitan's (the 2507 update's); the first release of Qwen3-235B-A22B has 1e6.
    "235B-A22B": _qwen3_moe(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, hidden_dim=12288, num_experts=128,
                            top_k=8, moe_hidden_dim=1536, rope_theta=5000000.0),
}
