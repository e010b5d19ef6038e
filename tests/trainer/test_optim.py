import torch
from torch import nn

from dtrain.config.schema import Optimizer
from dtrain.optim import build_optimizer, kernel_flags


def test_weight_decay_only_on_matrices():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer([model], Optimizer(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {p.ndim for p in decay["params"]} == {2}
    assert {p.ndim for p in no_decay["params"]} == {1} and len(no_decay["params"]) == 3


def test_auto_kernel_is_fused_on_cuda_foreach_on_cpu():
    assert kernel_flags("auto", torch.device("cuda")) == {"fused": True}
    assert kernel_flags("auto", torch.device("cpu")) == {"foreach": True}
    assert kernel_flags("for-loop", torch.device("cpu")) == {"foreach": False, "fused": False}


def test_optimizer_kind_and_hyperparameters():
    model = nn.Linear(3, 3)
    opt = build_optimizer([model], Optimizer(name="Adam", lr=0.5, beta1=0.8, beta2=0.9), torch.device("cpu"))
    assert type(opt) is torch.optim.Adam
    assert opt.defaults["lr"] == 0.5 and opt.defaults["betas"] == (0.8, 0.9)
