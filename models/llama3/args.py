"""Hyperparameters of the Llama 3 family and its size presets (flavors).

Every flavor name torchtitan 0.2.2 defines is its model, field for field (tests/reference/test_torchtitan_flavors.py);
``1B`` and ``3B`` (Llama 3.2, tied embeddings) and ``debugmodel_gqa`` are dtrain's own.

The trainer takes a flavor and overrides what depends on the run, e.g.
``replace(LLAMA3_FLAVORS["8B"], vocab_size=..., max_seq_len=..., tie_word_embeddings=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..rope import RopeScaling


@dataclass
class Llama3Args:
    """Shape and numerics of a Llama 3 transformer. The defaults are Llama 3 8B (8k context, no RoPE scaling)."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    # Key/value heads; fewer than n_heads is grouped-query attention (GQA), equal is multi-head attention.
    n_kv_heads: int = 8
    vocab_size: int = 128256
    # The SwiGLU hidden size is 8/3 * dim, times ffn_dim_multiplier, rounded up to a multiple of multiple_of.
    multiple_of: int = 1024
    ffn_dim_multiplier: float | None = 1.3
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    # Longest sequence the RoPE tables cover; the trainer sets it to its training seq_len.
    max_seq_len: int = 8192
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Llama3Args.{name} must be > 0, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"Llama3Args.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"Llama3Args.n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"Llama3Args head_dim = dim / n_heads = {self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def moe(self) -> None:
        """Llama 3 is dense: no block has a mixture of experts (models/decoder.py, ``DecoderArgs``)."""
        return None

    @property
    def ffn_hidden_dim(self) -> int:
        """Hidden width of the SwiGLU feed-forward, by Meta's published rule."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


# Llama 3.1 (8B, 70B, 405B) and 3.2 (1B, 3B) were published with a 128k context and RoPE scaling; 3.2 scales by 32.
# torchtitan 0.2.2 applies the 3.1 scaling to every Llama 3 flavor (RoPEScalingArgs is no option there).
_LLAMA31_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA32_SCALING = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

# torchtitan 0.2.2's debug shape: multi-head attention (16 heads of 16 features, as many kv heads), its FFN width by
# the default rule (multiple_of 256: 768). Its flex and varlen variants (and 8B's) are the same model; their
# block-causal mask is dtrain's document masking (training.attention_mask), a setting of the run.
_TORCHTITAN_DEBUG = Llama3Args(
    dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048, multiple_of=256, ffn_dim_multiplier=None,
    rope_scaling=_LLAMA31_SCALING, max_seq_len=2048,
)

_LLAMA31_8B = Llama3Args(
    dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, multiple_of=1024, ffn_dim_multiplier=1.3,
    rope_scaling=_LLAMA31_SCALING, max_seq_len=131072,
)

# Each flavor its own value (copies, not aliases), so that changing one in place never changes another.
LLAMA3_FLAVORS: dict[str, Llama3Args] = {
    "debugmodel": _TORCHTITAN_DEBUG,
    "debugmodel_flex_attn": replace(_TORCHTITAN_DEBUG),
    "debugmodel_varlen_attn": replace(_TORCHTITAN_DEBUG),
    # dtrain's own debug shape, where grouped-query attention is exercised: 8 query heads over 4 kv heads.
    "debugmodel_gqa": replace(_TORCHTITAN_DEBUG, n_heads=8, n_kv_heads=4),
    "1B": Llama3Args(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_scaling=_LLAMA32_SCALING,
        max_seq_len=131072,
        tie_word_embeddings=True,
    ),
    "3B": Llama3Args(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        multiple_of=256,
        ffn_dim_multiplier=1.0,
        rope_scaling=_LLAMA32_SCALING,
        max_seq_len=131072,
        tie_word_embeddings=True,
    ),
    "8B": _LLAMA31_8B,
    "8B_flex": replace(_LLAMA31_8B),
    "8B_varlen": replace(_LLAMA31_8B),
    "70B": Llama3Args(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_scaling=_LLAMA31_SCALING,
        max_seq_len=131072,
    ),
    "405B": Llama3Args(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        rope_scaling=_LLAMA31_SCALING,
        max_seq_len=131072,
    ),
}
