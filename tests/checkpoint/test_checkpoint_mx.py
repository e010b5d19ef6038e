"""MXFP8 training (torchao, the emulated recipe) through the trainer's checkpoint path: the MX-wrapped weights are
saved by DCP as torchao's wrapper class and read back by dtrain's safe (weights-only) reader, and training
continues bit-identically."""

from __future__ import annotations

import pytest
import torch
from checkpoint_helpers import make_cfg, manager_for, tiny_model, tiny_state, train

from dtrain.parallelize.torch_compat import MXFP8_TRAINING_SUPPORTED
from dtrain.precision.mx import build_mx_training
from dtrain.step.rng import seed_everything

pytest.importorskip("torchao.prototype.moe_training")
pytestmark = pytest.mark.skipif(not MXFP8_TRAINING_SUPPORTED, reason="torchao's MXFP8 training needs torch 2.13")


def test_mx_run_resumes_bit_identically(run_dir):
    cfg = make_cfg(run_dir)
    cfg.model.converters = ["mx"]
    cfg.quantize.linear.mx.recipe_name = "mxfp8_emulated_rceil"
    mx = build_mx_training(cfg.model.converters, cfg.quantize.linear.mx)

    def mx_state():
        seed_everything(cfg.debug.seed, "init")
        model = tiny_model()
        mx.convert(model)
        return tiny_state(cfg, model)

    state = mx_state()
    wrapped = [p for p in state.model_parts[0].parameters() if type(p).__name__ == "MXFP8TrainingWeightWrapperTensor"]
    assert wrapped  # the linears whose dimensions fit the MX block
    manager = manager_for(cfg, state)
    train(state, manager, 4, cfg)  # saves step-2 and step-4
    manager.close()

    resumed = mx_state()
    assert manager_for(cfg, resumed).restore_at_startup().step == 4
    assert train(resumed, None, 6, cfg) == train(state, None, 6, cfg)


def test_a_high_precision_run_resumes_an_mx_checkpoint(run_dir):
    cfg = make_cfg(run_dir)
    cfg.model.converters = ["mx"]
    cfg.quantize.linear.mx.recipe_name = "mxfp8_emulated_rceil"
    seed_everything(cfg.debug.seed, "init")
    model = tiny_model()
    build_mx_training(cfg.model.converters, cfg.quantize.linear.mx).convert(model)
    state = tiny_state(cfg, model)
    manager = manager_for(cfg, state)
    train(state, manager, 2, cfg)
    manager.close()

    cfg.model.converters = []
    plain = tiny_state(cfg)
    assert manager_for(cfg, plain).restore_at_startup().step == 2
    for (name, saved), loaded in zip(model.state_dict().items(), plain.model_parts[0].state_dict().values()):
        assert type(loaded) is torch.Tensor and torch.equal(loaded, saved.as_subclass(torch.Tensor)), name
