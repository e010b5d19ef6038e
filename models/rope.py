"""Rotary position embedding (RoPE), optionally with Llama 3.1 frequency scaling, in real arithmetic; shared by
every family.

Meta's reference multiplies complex numbers; here the same rotation is written with a cos/sin table, because complex
buffers are awkward under DTensor, bf16 and some compilers. The pairing matches the reference (and torchtitan):
feature ``2i`` and ``2i+1`` of each head form one rotating pair, so wq/wk checkpoints move between projects unchanged.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling (the ``rope_scaling`` block of the published configs).

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` keep their frequency, those
    longer than ``original_max_position_embeddings / low_freq_factor`` are slowed down by ``factor``, and the band in
    between is interpolated smoothly between the two.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"rope_scaling.low_freq_factor ({self.low_freq_factor})"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings must be > 0, "
                f"got {self.original_max_position_embeddings}"
            )


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The ``head_dim // 2`` angular frequencies (radians per position), float32, on the current default device."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return freqs
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    # 0 at the low-frequency end of the transition band, 1 at its high-frequency end.
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, interpolated)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def precompute_rope_cache(
    head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None, device: torch.device | str | None = None
) -> torch.Tensor:
    """The table ``[max_seq_len, head_dim]``: cos of every (position, frequency) angle, then their sin, float32.

    One tensor with positions first, so that context parallelism can shard it along the sequence like the inputs.
    """
    with torch.device(device) if device is not None else contextlib.nullcontext():
        freqs = rope_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_seq_len, dtype=torch.float32)
        angles = torch.outer(positions, freqs)
        return torch.cat([angles.cos(), angles.sin()], dim=-1)


def sequence_positions(seqlen: int, rope_cache: torch.Tensor) -> torch.Tensor:
    """``0 .. seqlen-1`` on the table's device, the positions of a whole sequence; ValueError past the table."""
    if seqlen > rope_cache.shape[0]:
        raise ValueError(
            f"sequence length {seqlen} exceeds the RoPE table's {rope_cache.shape[0]} positions; raise max_seq_len"
        )
    return torch.arange(seqlen, device=rope_cache.device)


def apply_rotary_emb(x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, seq, heads, head_dim]`` by the angles of its tokens' ``positions`` (``[seq]``, or
    ``[batch, seq]`` when sequences differ), rows of ``rope_cache``.

    The rotation is computed in float32 and cast back to ``x``'s dtype, as the reference does.
    """
    head_dim = x.shape[-1]
    table = rope_cache[positions].float()  # [seq, head_dim] or [batch, seq, head_dim]
    if table.ndim == 2:
        table = table.unsqueeze(0)
    cos, sin = table.unsqueeze(2).chunk(2, dim=-1)
    pairs = x.float().unflatten(-1, (head_dim // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)
