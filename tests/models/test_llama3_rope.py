"""RoPE: Llama 3.1 frequency scaling and the real-valued rotation, against straightforward references."""

import math

import pytest
import torch

from dtrain.models.llama3 import RopeScaling, apply_rotary_emb, precompute_rope_cache, rope_frequencies


def reference_scaled_frequencies(head_dim, theta, factor, low_freq_factor, high_freq_factor, old_context_len):
    """The Llama 3.1 formula, one frequency at a time, in Python floats."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_context_len / high_freq_factor:
            out.append(freq)
        elif wavelen > old_context_len / low_freq_factor:
            out.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


@pytest.mark.parametrize("head_dim, theta, factor", [(128, 500000.0, 8.0), (64, 500000.0, 32.0), (16, 10000.0, 4.0)])
def test_scaled_frequencies_match_the_formula(head_dim, theta, factor):
    old_context_len = 8192 if head_dim > 16 else 64
    expected = reference_scaled_frequencies(head_dim, theta, factor, 1.0, 4.0, old_context_len)
    unscaled = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    # The comparison must cover all three bands: kept, divided by factor, and interpolated.
    kept = sum(e == u for e, u in zip(expected, unscaled))
    divided = sum(math.isclose(e, u / factor) for e, u in zip(expected, unscaled))
    assert kept > 0 and divided > 0 and kept + divided < len(expected)

    got = rope_frequencies(head_dim, theta, RopeScaling(factor, 1.0, 4.0, old_context_len))
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=0)


def test_no_scaling_is_plain_rope():
    expected = [1.0 / 500000.0 ** (i / 32) for i in range(0, 32, 2)]
    torch.testing.assert_close(rope_frequencies(32, 500000.0, None), torch.tensor(expected), rtol=1e-6, atol=0)


def test_cache_holds_cos_then_sin_of_position_times_frequency():
    scaling = RopeScaling(8.0, 1.0, 4.0, 64)
    cache = precompute_rope_cache(16, 48, 10000.0, scaling)
    assert cache.shape == (48, 16) and cache.dtype == torch.float32
    freqs = reference_scaled_frequencies(16, 10000.0, 8.0, 1.0, 4.0, 64)
    angles = torch.tensor([[pos * f for f in freqs] for pos in range(48)], dtype=torch.float64)
    torch.testing.assert_close(cache.double(), torch.cat([angles.cos(), angles.sin()], -1), atol=2e-5, rtol=0)


def test_rotation_equals_complex_multiplication_of_adjacent_pairs():
    # Meta's reference (and torchtitan) view features (2i, 2i+1) as one complex number and multiply by e^{i angle}.
    torch.manual_seed(0)
    x = torch.randn(2, 10, 3, 16)
    cache = precompute_rope_cache(16, 12, 500000.0, RopeScaling(8.0, 1.0, 4.0, 8))
    freqs = rope_frequencies(16, 500000.0, RopeScaling(8.0, 1.0, 4.0, 8))
    rotation = torch.polar(torch.ones(10, 8), torch.outer(torch.arange(10, dtype=torch.float32), freqs))
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (8, 2))) * rotation[None, :, None, :])
    torch.testing.assert_close(apply_rotary_emb(x, cache, torch.arange(10)), expected.flatten(-2), atol=1e-5, rtol=1e-5)


def test_rotation_keeps_dtype():
    cache = precompute_rope_cache(8, 4, 10000.0, None)
    x = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    assert apply_rotary_emb(x, cache, torch.arange(4)).dtype == torch.bfloat16


def test_rotation_uses_the_given_positions():
    # A chunk of a sequence (as a context-parallel rank holds) rotates like those rows of the whole sequence,
    # and per-sequence positions ([batch, seq]) rotate each sequence by its own.
    torch.manual_seed(0)
    cache = precompute_rope_cache(8, 16, 10000.0, None)
    x = torch.randn(2, 12, 3, 8)
    whole = apply_rotary_emb(x, cache, torch.arange(12))
    chunk = torch.tensor([4, 5, 6, 9, 10])
    torch.testing.assert_close(apply_rotary_emb(x[:, chunk], cache, chunk), whole[:, chunk], rtol=0, atol=0)
    per_sequence = torch.stack([torch.arange(12), torch.arange(12)])
    torch.testing.assert_close(apply_rotary_emb(x, cache, per_sequence), whole, rtol=0, atol=0)
    shifted = apply_rotary_emb(x, cache, torch.arange(12) + 2)
    assert not torch.allclose(shifted, whole)
