"""The MoE step hooks in one process: the auxiliary loss sum and its number of terms, the per-layer load
statistics after a step (and the counts starting again), the loss-free bias moving only where configured, and
the metrics' names."""

from __future__ import annotations


import pytest
import torch

from dtrain.parallelize import get_family
from dtrain.parallelize.moe_hooks import (
    after_moe_step,
    aux_loss_enabled,
    moe_aux_loss,
    moe_aux_loss_terms,
    moe_layers,
    moe_step_metrics,
)

from parity_layouts import FAMILY_ARGS


def moe_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = get_family("qwen3").model.model_cls(FAMILY_ARGS[name])
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    return model


def test_aux_loss_is_the_sum_over_layers_and_only_where_enabled():
    model = moe_model("qwen3_moe")
    layers = moe_layers([model])
    assert len(layers) == 2 and all(moe.aux_loss is not None for moe in layers)
    assert torch.equal(moe_aux_loss([model]), layers[0].aux_loss + layers[1].aux_loss)
    assert moe_aux_loss_terms([model]) == 2
    bias_model = moe_model("qwen3_moe_bias")
    assert moe_aux_loss([bias_model]) is None and moe_aux_loss_terms([bias_model]) == 0
    assert aux_loss_enabled(FAMILY_ARGS["qwen3_moe"]) and not aux_loss_enabled(FAMILY_ARGS["qwen3_moe_bias"])
    assert not aux_loss_enabled(FAMILY_ARGS["qwen3"])


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_bias"])
def test_after_a_step_the_load_statistics_are_kept_and_the_counts_start_again(name):
    model = moe_model(name)
    layers = moe_layers([model])
    loads = [moe.tokens_per_expert.clone() for moe in layers]
    biases = [None if moe.expert_bias is None else moe.expert_bias.clone() for moe in layers]
    assert all(load.sum() == 2 * 16 * 2 for load in loads)  # tokens × top_k
    after_moe_step([model])
    metrics = moe_step_metrics([model])
    for index, (moe, load, bias) in enumerate(zip(layers, loads, biases)):
        assert metrics[f"moe/layers.{index}/load_imbalance"] == pytest.approx((load.max() / load.mean()).item())
        assert moe.tokens_per_expert.sum() == 0
        if bias is not None:  # underloaded experts become likelier picks; the change is centred (torchtitan's)
            step = 1e-3 * torch.sign(load.mean() - load)
            assert torch.equal(moe.expert_bias - bias, step - step.mean())
    assert metrics["moe/load_imbalance_max"] == max(metrics[f"moe/layers.{i}/load_imbalance"] for i in range(2))
    assert set(metrics) == {"moe/layers.0/load_imbalance", "moe/layers.1/load_imbalance", "moe/load_imbalance_max"}


def test_dense_models_have_no_moe_metrics():
    assert moe_step_metrics([get_family("qwen3").model.model_cls(FAMILY_ARGS["qwen3"])]) == {}
