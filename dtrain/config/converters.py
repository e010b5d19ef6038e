"""Checks of `[model] converters` and `[quantize.*]`: which converters exist, and what float8 and MX refuse.

Converter names follow torchtitan: v0.2.2 registers float8 as ``quantize.linear.float8`` and MX as
``quantize.linear.mx`` (older releases as ``float8`` and ``mx``); both spellings are accepted. What depends on the
torch version is checked by the pre-flight (dtrain/run/prepare.py), which knows it.
"""

from __future__ import annotations

import importlib.util

from dtrain.config.schema import JobConfig
from dtrain.config.torchtitan_keys import REFUSED_CONVERTERS
from dtrain.errors import ConfigError

FLOAT8_NAMES = ("float8", "quantize.linear.float8")
MX_NAMES = ("mx", "quantize.linear.mx")
MX_CAPABILITY = (10, 0)  # Blackwell: the first GPUs with MX (block-scaled) matmuls
MX_EMULATED_RECIPE = "mxfp8_emulated_rceil"


def float8_enabled(cfg: JobConfig) -> bool:
    return any(name in FLOAT8_NAMES for name in cfg.model.converters)


def mx_enabled(cfg: JobConfig) -> bool:
    return any(name in MX_NAMES for name in cfg.model.converters)


def cuda_capability() -> tuple[int, int] | None:
    """This machine's CUDA compute capability; None without a CUDA GPU."""
    import torch  # only when asked: importing the config must not import torch (nor torch.distributed with it)

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def has_mx_matmul() -> bool:
    capability = cuda_capability()
    return capability is not None and capability >= MX_CAPABILITY


def check_mx(cfg: JobConfig) -> None:
    """One-line refusals of MX training where it cannot run: no torchao, or an MX-matmul recipe without a
    Blackwell-class GPU."""
    recipe = cfg.quantize.linear.mx.recipe_name
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("model.converters = mx needs torchao (pip install torchao)")
    if recipe != MX_EMULATED_RECIPE and not has_mx_matmul():
        capability = cuda_capability()
        have = "no CUDA GPU" if capability is None else f"a GPU of compute capability {capability[0]}.{capability[1]}"
        raise ConfigError(
            f"quantize.linear.mx.recipe_name = {recipe} needs a Blackwell-class GPU (CUDA compute capability >= "
            f"10.0); this machine has {have} (recipe_name = {MX_EMULATED_RECIPE} emulates MX matmuls anywhere)"
        )
    if cfg.parallelism.tensor_parallel_degree > 1:
        raise ConfigError(
            "model.converters = mx does not compose with tensor parallel in dtrain; set "
            f"parallelism.tensor_parallel_degree = 1 (got {cfg.parallelism.tensor_parallel_degree})"
        )


def check_mx_compute_dtype(cfg: JobConfig, fsdp_enabled: bool) -> None:
    """Layouts without FSDP compute in bf16 under autocast, inside which torchao's emulated MX matmul fails: it
    dequantizes each operand to its own original dtype, which autocast made differ ("expected m1 and m2 to have
    the same dtype", torchao 0.18). FSDP's mixed-precision policy casts the weights instead, and works. The MX
    matmul recipes multiply float8 operands into a bf16 output and are not refused here (not yet run on a
    Blackwell GPU)."""
    param_dtype = cfg.training.mixed_precision_param
    recipe = cfg.quantize.linear.mx.recipe_name
    if mx_enabled(cfg) and recipe == MX_EMULATED_RECIPE and not fsdp_enabled and param_dtype != "float32":
        raise ConfigError(
            f"quantize.linear.mx.recipe_name = {recipe} on a layout without FSDP needs "
            f"training.mixed_precision_param = float32 (got {param_dtype}): the emulated MX matmuls do not run "
            "under the autocast such layouts compute in; shard with FSDP (parallelism.data_parallel_shard_degree) "
            "to emulate MX in bf16"
        )


def check_converters(cfg: JobConfig) -> None:
    """A one-line ConfigError for an unknown or refused converter, or an impossible float8 or MX combination."""
    for name in cfg.model.converters:
        if name in REFUSED_CONVERTERS:
            raise ConfigError(f"model.converters = {name} is not supported: {REFUSED_CONVERTERS[name]}")
        if name not in FLOAT8_NAMES + MX_NAMES:
            raise ConfigError(
                "model.converters may contain float8 or mx (or quantize.linear.float8, quantize.linear.mx); "
                f"got {name!r}"
            )
    if float8_enabled(cfg) and mx_enabled(cfg):
        raise ConfigError("model.converters: float8 and mx both convert the linears; choose one")
    if mx_enabled(cfg):
        check_mx(cfg)
    if float8_enabled(cfg) and importlib.util.find_spec("torchao") is None:
        raise ConfigError("model.converters = float8 needs torchao (pip install torchao)")
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
