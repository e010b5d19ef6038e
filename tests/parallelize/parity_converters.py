"""The trainer's low-precision linears (float8, MX) for the parity tests, built from a layout's
[quantize.linear.<converter>] keys through the same builders the trainer calls."""

from __future__ import annotations

import torch

from dtrain.config.schema import JobConfig
from dtrain.parallelize import ParallelDims
from dtrain.precision.float8 import Float8Training, build_float8_training
from dtrain.precision.mx import MXTraining, build_mx_training


def converter_config(converter: str, **keys) -> JobConfig:
    """A config with `model.converters = [converter]` ("float8" or "mx") and these keys of its
    [quantize.linear.<converter>] section."""
    cfg = JobConfig()
    cfg.model.converters = [converter]
    section = getattr(cfg.quantize.linear, converter)
    for key, value in keys.items():
        setattr(section, key, value)
    return cfg


def float8_of(cfg: JobConfig, fsdp_enabled: bool) -> Float8Training | None:
    """The trainer's float8 setup for `cfg`'s sections, on the CPU."""
    return build_float8_training(
        cfg.model.converters, cfg.quantize.linear.float8, cfg.parallelism.tensor_parallel_degree, fsdp_enabled,
        torch.device("cpu"),
    )


def mx_of(cfg: JobConfig) -> MXTraining | None:
    """The trainer's MX setup for `cfg`'s sections."""
    return build_mx_training(cfg.model.converters, cfg.quantize.linear.mx)


def float8_training(float8: dict | None, dims: ParallelDims) -> Float8Training | None:
    """The trainer's float8 setup for a layout's [quantize.linear.float8] keys (None: no float8)."""
    if float8 is None:
        return None
    return float8_of(converter_config("float8", **float8), dims.fsdp_enabled)


def low_precision(
    float8: dict | None, mx: dict | None, dims: ParallelDims
) -> Float8Training | MXTraining | None:
    """The trainer's converter for a layout's [quantize.linear.float8] or [quantize.linear.mx] keys, if any."""
    return float8_training(float8, dims) if mx is None else mx_of(converter_config("mx", **mx))
