"""YaRN rotary embedding for DeepSeek's decoupled RoPE key: frequencies, the cos/sin table and the attention scale.

DeepSeek-V2 and V3 were pretrained at 4K tokens and then extended to 128K with YaRN: the fast-rotating frequencies
keep their speed (they resolve nearby tokens), the slow ones are slowed down by ``factor`` so that long distances
stay within the angles seen in pretraining, and a ramp between ``beta_fast`` and ``beta_slow`` rotations over the
original length blends the two. YaRN also sharpens attention as the context grows, by ``mscale``: Hugging Face's
DeepseekV3 (whose numerics we reproduce) applies it twice, once as a factor on the cos/sin table (the rotary part
of every score) and once as ``mscale(mscale_all_dim) ** 2`` on the softmax scale (every score); for the published
models ``mscale == mscale_all_dim``, so the first is 1.

The table has the layout of ``dtrain.models.rope`` (``[positions, cos | sin]``), so its ``apply_rotary_emb``, the
context-parallel sharding of the table and the interleaved pairing (features 2i, 2i+1) all carry over unchanged.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YarnScaling:
    """The ``rope_scaling`` block (``"type": "yarn"``) of the DeepSeek configs."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # 0 for either means "not given" in Hugging Face's rule: the softmax scale is then left alone (mscale_all_dim
    # 0) and the table's factor is mscale(factor) (either 0), else mscale(factor, mscale) / mscale(factor, all_dim).
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        if self.factor < 1:
            raise ValueError(f"rope_scaling.factor must be >= 1 (1 is plain RoPE), got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings must be > 0, "
                f"got {self.original_max_position_embeddings}"
            )
        if not self.beta_fast > self.beta_slow > 0:
            raise ValueError(
                f"rope_scaling needs beta_fast > beta_slow > 0, got beta_fast={self.beta_fast}, "
                f"beta_slow={self.beta_slow}"
            )
        if self.mscale < 0 or self.mscale_all_dim < 0:
            raise ValueError(
                f"rope_scaling.mscale and mscale_all_dim must be >= 0, got {self.mscale} and {self.mscale_all_dim}"
            )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context ``factor`` times the original: ``0.1 mscale ln(factor) + 1``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def table_scale(scaling: YarnScaling | None) -> float:
    """The factor on the cos/sin table (on each rotary query and key feature)."""
    if scaling is None:
        return 1.0
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def softmax_scale_factor(scaling: YarnScaling | None) -> float:
    """The factor on ``1 / sqrt(qk_head_dim)``, the softmax scale of every attention score."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def yarn_frequencies(rope_dim: int, theta: float, scaling: YarnScaling | None) -> torch.Tensor:
    """The ``rope_dim // 2`` angular frequencies, float32, on the current default device."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if scaling is None:
        return freqs

    def dimension_of(rotations: float) -> float:
        # The feature pair that turns `rotations` times over the original context.
        return rope_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta)
        )

    low = max(math.floor(dimension_of(scaling.beta_fast)), 0)
    high = min(math.ceil(dimension_of(scaling.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # a ramp of width 0 would divide by 0
    # 0 up to `low` (keep the frequency), 1 from `high` on (slow it down by `factor`), linear in between.
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return freqs / scaling.factor * ramp + freqs * (1 - ramp)


def precompute_yarn_rope_cache(
    rope_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: YarnScaling | None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The table ``[max_seq_len, rope_dim]``: cos of every (position, frequency) angle, then their sin, float32,
    both times ``table_scale(scaling)``."""
    with torch.device(device) if device is not None else contextlib.nullcontext():
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), yarn_frequencies(rope_dim, theta, scaling))
        return torch.cat([angles.cos(), angles.sin()], dim=-1) * table_scale(scaling)
