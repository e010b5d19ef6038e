"""Checks of `[model] converters` and `[quantize.*]`: which converters exist, and what float8 refuses.

Converter names follow torchtitan: v0.2.2 registers float8 as ``quantize.linear.float8`` (older releases as
``float8``); both are accepted. MX (mxfp8) is refused: it needs a Blackwell-class GPU and dtrain does not implement
it yet.
"""

from __future__ import annotations

import importlib.util

import torch

from dtrain.config.schema import JobConfig
from dtrain.errors import ConfigError

FLOAT8_NAMES = ("float8", "quantize.linear.float8")
MX_NAMES = ("mx", "quantize.linear.mx")
MX_SECTION = "quantize.linear.mx"
MX_CAPABILITY = (10, 0)  # Blackwell: the first GPUs with MX (block-scaled) matmuls


def float8_enabled(cfg: JobConfig) -> bool:
    return any(name in FLOAT8_NAMES for name in cfg.model.converters)


def mx_refusal(key: str) -> str:
    """The one-line refusal of MX training, naming `key` and what this machine lacks."""
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if capability is None or capability < MX_CAPABILITY:
        have = "no CUDA GPU" if capability is None else f"a GPU of compute capability {capability[0]}.{capability[1]}"
        reason = f"needs a Blackwell-class GPU (CUDA compute capability >= 10.0); this machine has {have}"
    else:
        reason = "is not implemented in dtrain yet"
    return f"{key}: MX (mxfp8) training {reason} (valid converters: float8)"


def refused_key_message(name: str, where: str = "") -> str | None:
    """The refusal of a key or section under [quantize.linear.mx] (rather than "unknown key"), else None."""
    if name == MX_SECTION or name.startswith(MX_SECTION + "."):
        return mx_refusal(f"[{MX_SECTION}]{where}")
    return None


def check_converters(cfg: JobConfig) -> None:
    """A one-line ConfigError for an unknown or refused converter, or an impossible float8 combination."""
    for name in cfg.model.converters:
        if name in MX_NAMES:
            raise ConfigError(mx_refusal(f"model.converters = {name}"))
        if name not in FLOAT8_NAMES:
            raise ConfigError(f"model.converters may contain float8 (or quantize.linear.float8); got {name!r}")
    if float8_enabled(cfg) and importlib.util.find_spec("torchao") is None:
        raise ConfigError("model.converters = float8 needs torchao (pip install torchao)")
    if float8_enabled(cfg) and cfg.parallelism.tensor_parallel_degree > 1:
        # torchao's float8 TP styles are not wired into the TP plans yet: on gloo their float8 all-gathers fail
        # and without sequence parallel the CPU run did not match one process, so nothing here could verify them.
        raise ConfigError(
            "model.converters = float8 does not compose with tensor parallel yet; set "
            f"parallelism.tensor_parallel_degree = 1 (got {cfg.parallelism.tensor_parallel_degree})"
        )
    f8 = cfg.quantize.linear.float8
    key = "quantize.linear.float8"
    if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
        raise ConfigError(
            f"{key}.enable_fsdp_float8_all_gather needs {key}.recipe_name = tensorwise (got {f8.recipe_name})"
        )
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        raise ConfigError(
            f"{key}.precompute_float8_dynamic_scale_for_fsdp needs {key}.enable_fsdp_float8_all_gather = true"
        )
