"""float8 training (torchao, emulated on CPU) in one process: which linears convert, the loss against fp32, compile.

The FSDP2 layout with float8 all-gathers is in test_parity_fsdp_ddp.py.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from parity_converters import converter_config, float8_of
from parity_layouts import (
    ARGS,
    build_parallel_model,
    max_relative_diff,
    new_state,
    run_steps,
    single_process_run,
    whole_model,
)
from torch import nn

from dtrain.config import JobConfig
from dtrain.parallelize import ParallelDims, ParallelizeOptions

pytest.importorskip("torchao.float8")


def float8_config(**float8) -> JobConfig:
    return converter_config("float8", **float8)


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
        float8 = float8_of(float8_config(filter_fqns=["output", "proj"]), False)
    model = Tiny()
    float8.convert(model)
    converted = {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert converted == {"up"}
    assert model.up.config.emulate  # chosen because this CPU has no float8 matmuls
    assert "no float8 matmuls" in caplog.text and "emulating them" in caplog.text


def test_precompute_hook_only_with_fsdp_float8_all_gather(caplog):
    cfg = float8_config(enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True)
    assert float8_of(cfg, True).optimizer_step_hook is not None
    assert "has no effect" not in caplog.text
    # Without FSDP there is nothing to all-gather (torchtitan's rule): both flags are moot, and the log says so.
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        single = float8_of(cfg, False)
    assert single.optimizer_step_hook is None and not single.config.enable_fsdp_float8_all_gather
    assert "enable_fsdp_float8_all_gather (and the scale precompute) has no effect" in caplog.text
    assert float8_of(JobConfig(), True) is None


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
    float8 = float8_of(float8_config(), False)
    dims = ParallelDims(1)
    options = ParallelizeOptions(compile_model=True, compile_backend="aot_eager")
    torch._dynamo.reset()
    model = build_parallel_model(ARGS, dims, None, options, converter=float8)
    compiled = run_steps(new_state(whole_model(model), dims, converter=float8), range(steps), None, accumulation=2)
    eager, _ = single_process_run(ARGS, float8={})
    # aot_eager runs the same kernels as eager; only the graph's op order may differ.
    assert max_relative_diff(compiled["losses"], eager["losses"][:steps]) <= 1e-5


class Block(nn.Module):
    """A feed-forward block as the TP plans see one: an input-preparing parent and its linears."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)


def float8_blocks(recipe: str = "tensorwise", filter_fqns: tuple[str, ...] = ()) -> nn.Module:
    model = nn.ModuleDict({"0": Block(), "1": Block()})
    float8_of(float8_config(recipe_name=recipe, filter_fqns=list(filter_fqns)), False).convert(model)
    return model


def chosen_styles(model: nn.Module, plan: dict, float8_collectives: bool) -> dict[str, str]:
    from dtrain.parallelize.float8_tp import float8_style
    from dtrain.parallelize.tensor_parallel import modules_at

    return {
        path: type(float8_style(style, modules_at(model, path), float8_collectives)).__name__
        for path, style in plan.items()
    }


def sequence_parallel_plan() -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    return {
        "*": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "*.up": ColwiseParallel(),
        "*.down": RowwiseParallel(output_layouts=Shard(1)),
    }


def test_float8_tp_styles_where_the_collectives_carry_float8():
    # NCCL: torchtitan's float8 TP, every collective in float8.
    assert chosen_styles(float8_blocks(), sequence_parallel_plan(), float8_collectives=True) == {
        "*": "PrepareFloat8ModuleInput", "*.up": "Float8ColwiseParallel", "*.down": "Float8RowwiseParallel",
    }


def test_float8_tp_styles_without_float8_collectives_keep_float8_off_gathers():
    # gloo: the sequence gather and the row-parallel output's backward gather stay torch's (high precision).
    assert chosen_styles(float8_blocks(), sequence_parallel_plan(), float8_collectives=False) == {
        "*": "PrepareModuleInput", "*.up": "Float8ColwiseParallel", "*.down": "RowwiseParallel",
    }


def test_float8_tp_styles_only_for_tensorwise_float8_linears():
    plan = sequence_parallel_plan()
    torch_styles = {"*": "PrepareModuleInput", "*.up": "ColwiseParallel", "*.down": "RowwiseParallel"}
    assert chosen_styles(float8_blocks("rowwise"), plan, float8_collectives=True) == torch_styles
    # One high-precision linear in the block: its input must not arrive cast to float8.
    assert chosen_styles(float8_blocks(filter_fqns=("down",)), plan, float8_collectives=True) == {
        "*": "PrepareModuleInput", "*.up": "Float8ColwiseParallel", "*.down": "RowwiseParallel",
    }


def test_float8_tp_plan_is_free_for_runs_that_never_loaded_torchao(monkeypatch):
    from dtrain.parallelize.float8_tp import float8_tp_plan

    plan = sequence_parallel_plan()
    monkeypatch.delitem(sys.modules, "torchao.float8.float8_linear")
    # Neither torchao nor the TP group is consulted (there is no mesh here).
    assert float8_tp_plan(plan, nn.ModuleDict({"0": Block()}), tp_mesh=None) is plan
