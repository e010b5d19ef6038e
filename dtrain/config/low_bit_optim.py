"""torchao's low-bit optimizer states by optimizer.name: how each stores the Adam moments of a tensor it quantizes.

Plain data, importable by the config checks without torch or torchao (dtrain.step.optimizer builds the optimizers).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LowBitFormat:
    """How one of torchao's low-bit optimizers stores each moment of a tensor it quantizes: `code_bytes` per
    element, a float32 scale per block of `block_size` elements and a `qmap_bytes` lookup table."""

    code_bytes: float
    block_size: int
    qmap_bytes: int


# torchao's formats by name suffix, with its default block sizes (passed explicitly, so that the memory estimate,
# dtrain.step.optimizer.moment_bytes, and the optimizer agree). The 8-bit table has 256 float32 values, the 4-bit one 16;
# float8 needs none.
LOW_BIT_FORMATS = {
    "8bit": LowBitFormat(code_bytes=1, block_size=256, qmap_bytes=256 * 4),
    "4bit": LowBitFormat(code_bytes=0.5, block_size=128, qmap_bytes=16 * 4),
    "Fp8": LowBitFormat(code_bytes=1, block_size=256, qmap_bytes=0),
}
# torchao quantizes a tensor's moments only if it has this many elements (bitsandbytes' rule) and whole blocks.
MIN_QUANTIZED_NUMEL = 4096


def low_bit_suffix(name: str) -> str | None:
    """The moment format's key in LOW_BIT_FORMATS of optimizer.name `name` (8bit for AdamW8bit), None for torch's
    AdamW and Adam (float moments)."""
    return next((suffix for suffix in LOW_BIT_FORMATS if name.endswith(suffix)), None)


def low_bit_format(name: str) -> LowBitFormat | None:
    """The moment format of optimizer.name `name` (AdamW8bit, Adam4bit, ...), None for torch's AdamW and Adam."""
    suffix = low_bit_suffix(name)
    return LOW_BIT_FORMATS[suffix] if suffix else None


def quantizes(fmt: LowBitFormat, local_numel: int) -> bool:
    """Whether torchao keeps the moments of a (local shard of a) tensor of `local_numel` elements quantized."""
    return local_numel >= MIN_QUANTIZED_NUMEL and local_numel % fmt.block_size == 0
