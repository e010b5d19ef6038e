"""float8 training (torchao, emulated on CPU) in one process: which linears convert, the loss against fp32, compile.

The FSDP2 layout with float8 all-gathers is in test_parity_fsdp_ddp.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from dtrain.config import JobConfig
from dtrain.float8 import build_float8_training
from dtrain.parallelize import ParallelDims, ParallelizeOptions

from parity_layouts import (
    ARGS, build_parallel_model, max_relative_diff, new_state, run_steps, single_process_run, whole_model,
)

pytest.importorskip("torchao.float8")


def float8_config(**float8) -> JobConfig:
    cfg = JobConfig()
    cfg.model.converters = ["float8"]
    for key, value in float8.items():
        setattr(cfg.quantize.linear.float8, key, value)
    return cfg


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 24)  # 24 is not a multiple of 16: float8 matmuls cannot take it
        self.down = nn.Linear(24, 32)
        self.proj = nn.Linear(32, 32)
        self.output = nn.Linear(32, 48)


def test_converts_the_linears_that_fit_and_are_not_filtered(caplog):
    with caplog.at_level(logging.INFO, logger="dtrain"):
        float8 = build_float8_training(float8_config(filter_fqns=["output", "proj"]), False, torch.device("cpu"))
    model = Tiny()
    float8.convert(model)
    converted = {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert converted == {"up"}
    assert model.up.config.emulate  # chosen because this CPU has no float8 matmuls
    assert "no float8 matmuls" in caplog.text and "emulating them" in caplog.text


def test_precompute_hook_only_with_fsdp_float8_all_gather(caplog):
    cfg = float8_config(enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True)
    assert build_float8_training(cfg, True, torch.device("cpu")).optimizer_step_hook is not None
    assert "has no effect" not in caplog.text
    # Without FSDP there is nothing to all-gather (torchtitan's rule): both flags are moot, and the log says so.
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        single = build_float8_training(cfg, False, torch.device("cpu"))
    assert single.optimizer_step_hook is None and not single.config.enable_fsdp_float8_all_gather
    assert "enable_fsdp_float8_all_gather (and the scale precompute) has no effect" in caplog.text
    assert build_float8_training(JobConfig(), True, torch.device("cpu")) is None


@pytest.fixture(scope="module")
def fp32_run() -> dict:
    return single_process_run(ARGS)[0]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_loss_tracks_the_fp32_loss(fp32_run, recipe):
    # e4m3 keeps 3 mantissa bits (up to 1/16 relative error per element). Over dot products of 64 to 192 terms
    # and a loss averaged over 128 tokens those errors mostly cancel: measured 2e-3 at most over 10 steps. 1e-2
    # leaves room for other torch/torchao versions while a wrong scale or cast shows up as a difference of O(1).
    float8, _ = single_process_run(ARGS, float8=dict(recipe_name=recipe))
    diff = max_relative_diff(float8["losses"], fp32_run["losses"])
    assert 0 < diff <= 1e-2  # nonzero: the linears really ran in float8
    assert float8["losses"][-1] < 0.6 * float8["losses"][0]


def test_compiled_float8_blocks_match_eager():
    steps = 3
    float8 = build_float8_training(float8_config(), False, torch.device("cpu"))
    dims = ParallelDims(1)
    options = ParallelizeOptions(compile_model=True, compile_backend="aot_eager")
    torch._dynamo.reset()
    model = build_parallel_model(ARGS, dims, None, options, float8=float8)
    compiled = run_steps(new_state(whole_model(model), dims, float8=float8), range(steps), None, accumulation=2)
    eager, _ = single_process_run(ARGS, float8={})
    # aot_eager runs the same kernels as eager; only the graph's op order may differ.
    assert max_relative_diff(compiled["losses"], eager["losses"][:steps]) <= 1e-5
