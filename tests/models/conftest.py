"""A tiny Llama 3 shape shared by the model tests: GQA (4 query heads over 2 kv heads) and RoPE scaling on."""

import pytest

from dtrain.models.llama3 import Llama3Args, RopeScaling


@pytest.fixture
def tiny_args() -> Llama3Args:
    # original_max_position_embeddings is small so that, with head_dim 16, all three frequency bands occur.
    return Llama3Args(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=128,
        multiple_of=16,
        ffn_dim_multiplier=None,
        rope_theta=10000.0,
        rope_scaling=RopeScaling(
            factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
        ),
        max_seq_len=32,
    )
