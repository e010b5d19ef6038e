"""Hyperparameters of the Qwen3 (dense) family and its published size presets (flavors).

Unlike Llama 3, the head size is its own field (``n_heads * head_dim`` need not equal ``dim``), the FFN width is
given directly, queries and keys are RMS-normalised per head (QK-norm), RoPE has no frequency scaling, and the
small models tie the embedding to the head. Flavor names and shapes are torchtitan's and the published ones.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Qwen3Args:
    """Shape and numerics of a Qwen3 transformer. The defaults are Qwen3-8B."""

    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    # Width of the SwiGLU feed-forward (HF's intermediate_size).
    hidden_dim: int = 12288
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    # Longest sequence the RoPE tables cover; the trainer sets it to at least its training seq_len.
    max_seq_len: int = 4096
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Qwen3Args.{name} must be > 0, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"Qwen3Args.n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Args.head_dim ({self.head_dim}) must be even for RoPE")

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


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    # torchtitan's debug shape: small enough for a CPU, with head_dim (128) independent of dim (256).
    "debugmodel": _qwen3(dim=256, n_layers=8, n_heads=16, hidden_dim=3072, tie=True, vocab_size=2048),
    "0.6B": _qwen3(dim=1024, n_layers=28, n_heads=16, hidden_dim=3072, tie=True),
    "1.7B": _qwen3(dim=2048, n_layers=28, n_heads=16, hidden_dim=6144, tie=True),
    "4B": _qwen3(dim=2560, n_layers=36, n_heads=32, hidden_dim=9728, tie=True),
    "8B": _qwen3(dim=4096, n_layers=36, n_heads=32, hidden_dim=12288, tie=False),
    "14B": _qwen3(dim=5120, n_layers=40, n_heads=40, hidden_dim=17408, tie=False),
    "32B": _qwen3(dim=5120, n_layers=64, n_heads=64, hidden_dim=25600, tie=False),
}
