"""MXFP8 training (torchao, the emulated recipe on CPU) in one process: which linears convert, the loss against
fp32. FSDP2 with MX is in test_parity_fsdp_ddp.py."""

from __future__ import annotations

import pytest
import torch
from parity_converters import converter_config, mx_of
from parity_layouts import ARGS, max_relative_diff, single_process_run
from torch import nn

from dtrain.config import JobConfig
from dtrain.parallelize.torch_compat import MXFP8_TRAINING_SUPPORTED

pytest.importorskip("torchao.prototype.moe_training")
pytestmark = pytest.mark.skipif(not MXFP8_TRAINING_SUPPORTED, reason="torchao's MXFP8 training needs torch 2.13")

EMULATED = dict(recipe_name="mxfp8_emulated_rceil")


def test_converts_the_linears_that_fit_the_mx_block_and_are_not_filtered():
    model = nn.ModuleDict(
        {"up": nn.Linear(64, 128), "odd": nn.Linear(128, 48), "output": nn.Linear(64, 64)}  # 48: not a multiple of 32
    )
    mx_of(converter_config("mx", **EMULATED)).convert(model)
    wrapped = {name for name, m in model.items() if type(m.weight).__name__ == "MXFP8TrainingWeightWrapperTensor"}
    assert wrapped == {"up"}
    assert isinstance(model["up"].weight, nn.Parameter)  # still the optimizer's master weight


def test_no_mx_without_the_converter():
    assert mx_of(JobConfig()) is None


def test_mx_loss_tracks_the_fp32_loss():
    # MXFP8 (e4m3 with one power-of-two scale per 32 elements) rounds each element by up to 1/16, like float8, but
    # its scales follow the data block by block; over 10 steps of the tiny model it stays as close to fp32 as
    # float8 does (test_float8.py): 1e-2 bounds it, while a wrong scale or block layout would show as O(1).
    fp32, _ = single_process_run(ARGS)
    mx, _ = single_process_run(ARGS, mx=EMULATED)
    diff = max_relative_diff(mx["losses"], fp32["losses"])
    assert 0 < diff <= 1e-2  # nonzero: the linears really ran in MXFP8
    assert mx["losses"][-1] < 0.6 * mx["losses"][0]
    assert torch.isfinite(torch.tensor(mx["grad_norms"])).all()
