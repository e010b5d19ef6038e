"""Dense peak FLOP/s of known accelerators: the denominator of MFU (model FLOPs utilization).

Numbers are the vendors' datasheet peaks *without* 2:4 structured sparsity (datasheets often print the sparse
figure, twice the dense one; training never runs sparse). A device is recognised by its
``torch.cuda.get_device_name`` string. An unknown device, a MIG slice, or a CPU has no peak: MFU is then not
reported at all, because a borrowed number from another GPU would be a confident-looking wrong figure.

float32 training: on Ampere and newer NVIDIA GPUs a float32 matmul runs on the TF32 tensor cores only when PyTorch
allows it (``torch.backends.cuda.matmul.fp32_precision = "tf32"``, ``allow_tf32 = True`` or
``torch.set_float32_matmul_precision("high")``). Otherwise it runs on the plain FP32 units, whose peak is 8-16x
lower, and that is the number MFU is measured against. AMD Instinct GPUs are always measured against their FP32
matrix peak: ROCm enables TF32 through hipBLASLt environment variables, which PyTorch's flag does not control.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PeakFlops:
    """Dense peak FLOP/s of one device for the dtypes training computes in.

    ``half`` is the bf16/fp16 tensor-core peak, ``tf32`` the TF32 tensor-core peak (None where PyTorch's TF32
    flag does not select it), ``fp32`` the peak of plain float32 math.
    """

    half: float
    tf32: float | None
    fp32: float


_H100_SXM = PeakFlops(half=989e12, tf32=494.7e12, fp32=67e12)
_H100_NVL = PeakFlops(half=835e12, tf32=417.5e12, fp32=60e12)
_MI300X = PeakFlops(half=1307.4e12, tf32=None, fp32=163.4e12)

# (pattern searched in the device name, peaks). Ordered: the first match wins, so a specific variant (H100 NVL)
# comes before its family (H100). Word boundaries keep "L4" from matching "L40S" and "A10" from "A100" or "A10G".
_KNOWN_DEVICES: tuple[tuple[str, PeakFlops], ...] = (
    (r"\bGB200\b", PeakFlops(half=2.5e15, tf32=1.25e15, fp32=80e12)),
    (r"\bB200\b", PeakFlops(half=2.25e15, tf32=1.1e15, fp32=75e12)),
    (r"\bGH200\b", _H100_SXM),
    (r"\bH200\b.*\bNVL\b", _H100_NVL),
    (r"\bH200\b", _H100_SXM),
    (r"\bH100\b.*\bNVL\b", _H100_NVL),
    (r"\bH100\b.*\bPCIe\b", PeakFlops(half=756e12, tf32=378e12, fp32=51e12)),
    (r"\bH100\b", _H100_SXM),
    (r"\bA100\b", PeakFlops(half=312e12, tf32=156e12, fp32=19.5e12)),
    (r"\bA40\b", PeakFlops(half=149.7e12, tf32=74.8e12, fp32=37.4e12)),
    (r"\bA10G\b", PeakFlops(half=70e12, tf32=35e12, fp32=35e12)),
    (r"\bA10\b", PeakFlops(half=125e12, tf32=62.5e12, fp32=31.2e12)),
    (r"\bL40S\b", PeakFlops(half=362.05e12, tf32=183e12, fp32=91.6e12)),
    (r"\bL40\b", PeakFlops(half=181.05e12, tf32=90.5e12, fp32=90.5e12)),
    (r"\bL4\b", PeakFlops(half=121e12, tf32=60e12, fp32=30.3e12)),
    (r"\bMI325X\b", _MI300X),
    (r"\bMI300X\b", _MI300X),
)


def lookup_peak_flops(device_name: str) -> PeakFlops | None:
    """The peaks of the device called ``device_name``, or None when it is unknown or a MIG slice of a GPU."""
    # A MIG instance owns only a fraction of the GPU's SMs; the whole GPU's peak would understate MFU.
    if re.search(r"\bMIG\b", device_name):
        return None
    for pattern, peaks in _KNOWN_DEVICES:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peaks
    return None


def tf32_matmul_enabled() -> bool:
    """Whether PyTorch currently lets float32 CUDA matmuls run on TF32 tensor cores."""
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:
        # PyTorch refuses to read the legacy flag once the newer fp32_precision API has been set; that one rules.
        return torch.backends.cuda.matmul.fp32_precision == "tf32"


def peak_flops_for_name(device_name: str, dtype: torch.dtype, allow_tf32: bool) -> float | None:
    """Dense peak FLOP/s of ``device_name`` computing in ``dtype``; None if the device or the dtype is not covered."""
    peaks = lookup_peak_flops(device_name)
    if peaks is None:
        return None
    if dtype in (torch.bfloat16, torch.float16):
        return peaks.half
    if dtype == torch.float32:
        return peaks.tf32 if allow_tf32 and peaks.tf32 is not None else peaks.fp32
    return None


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of ``device`` computing in ``dtype`` (the compute dtype of the model's matmuls).

    None for a CPU, an unknown accelerator, a MIG slice, or a dtype without a listed peak: MFU is then shown as
    unknown rather than guessed.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device), dtype, tf32_matmul_enabled())
