"""LoRA as a model transform on one process: the adapter against PEFT's own LoRA layer, the init, what training
moves (adapters) and what it leaves alone (the frozen base, with no gradients and no optimizer state), target
patterns, and the one-line refusals."""

from __future__ import annotations

import copy
import math
import re
from dataclasses import replace

import pytest
import torch
from torch import nn

from dtrain.config.schema import JobConfig, LoRA, Optimizer
from dtrain.config.validate import validate_config
from dtrain.errors import ConfigError
from dtrain.models.qwen3 import Qwen3Args
from dtrain.parallelize import get_family
from dtrain.precision.lora import (
    LoRALinear, apply_lora, check_lora_layout, init_lora_weights, lora_state_dict, lora_targets,
)
from dtrain.step.optimizer import build_optimizers

ARGS = get_family("llama3").model.flavors["debugmodel"]
TINY = replace(ARGS, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=16)
QWEN3_MOE = Qwen3Args(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96, vocab_size=256, max_seq_len=16,
    moe_num_experts=4, moe_top_k=2, moe_hidden_dim=32,
)


def lora_model(settings: LoRA, args=TINY, family: str = "llama3") -> tuple[nn.Module, nn.Module]:
    """(base, LoRA copy of it): a seeded base model, and the same weights with adapters (PEFT's init)."""
    torch.manual_seed(0)
    base = get_family(family).model.model_cls(args)
    model = copy.deepcopy(base)
    apply_lora(model, settings)
    init_lora_weights(model, seed=0)
    return base, model


def test_a_lora_model_with_zero_lora_b_is_its_base():
    base, model = lora_model(LoRA(enable=True, target_modules=["all-linear", "output"]))
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    assert torch.equal(model(tokens), base(tokens))
    # Nonzero adapters change it: the comparison above can fail.
    for module in model.modules():
        if isinstance(module, LoRALinear):
            nn.init.normal_(module.lora_b.weight)
    assert not torch.allclose(model(tokens), base(tokens))


def test_base_names_are_unchanged_and_adapters_are_added():
    base, model = lora_model(LoRA(enable=True, target_modules=["wq", "w2"]))
    names = set(model.state_dict())
    assert set(base.state_dict()) <= names
    assert names - set(base.state_dict()) == {
        f"layers.{i}.{path}.{ab}.weight"
        for i in range(TINY.n_layers) for path in ("attention.wq", "feed_forward.w2") for ab in ("lora_a", "lora_b")
    }


def test_training_moves_the_adapters_only():
    _, model = lora_model(LoRA(enable=True, rank=4, target_modules=["all-linear"]))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_optimizers([model], Optimizer(lr=1e-2), torch.device("cpu"))
    tokens = torch.randint(0, TINY.vocab_size, (2, 17))
    for _ in range(3):
        logits = model(tokens[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, param in model.named_parameters():
        adapter = ".lora_a." in name or ".lora_b." in name
        assert param.requires_grad == adapter, name
        assert torch.equal(param, before[name]) != adapter, name
    stateful = {name for name, p in model.named_parameters() if optimizer.optimizers[0].state.get(p)}
    assert stateful == {name for name in before if ".lora_" in name}


@pytest.mark.parametrize("use_rslora", [False, True])
def test_the_adapter_computes_as_peft_lora_linear(use_rslora):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 24, bias=True))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0"], use_rslora=use_rslora, lora_dropout=0.0)
    theirs = peft.get_peft_model(copy.deepcopy(base), config).base_model.model[0]
    nn.init.normal_(theirs.lora_B["default"].weight)  # PEFT starts B at zero too; make the update visible
    ours = LoRALinear(copy.deepcopy(base[0]), rank=4, alpha=8, use_rslora=use_rslora)
    ours.lora_a.weight.data.copy_(theirs.lora_A["default"].weight)
    ours.lora_b.weight.data.copy_(theirs.lora_B["default"].weight)
    assert ours.scaling == theirs.scaling["default"] == (8 / 2 if use_rslora else 8 / 4)
    x = torch.randn(3, 5, 32)
    assert torch.equal(ours(x), theirs(x))


def test_init_is_peft_default_and_seeded_per_module():
    _, model = lora_model(LoRA(enable=True, target_modules=["wq", "wk"]))
    wq, wk = model.layers["0"].attention.wq, model.layers["0"].attention.wk
    bound = 1 / math.sqrt(TINY.dim)  # kaiming_uniform(a=sqrt(5)) of an [r, in] weight: U(-1/sqrt(in), 1/sqrt(in))
    assert wq.lora_a.weight.abs().max() <= bound and wq.lora_a.weight.std() > bound / 4
    assert torch.equal(wq.lora_b.weight, torch.zeros_like(wq.lora_b.weight))
    assert not torch.equal(wq.lora_a.weight, wk.lora_a.weight)
    again = lora_model(LoRA(enable=True, target_modules=["wq"]))[1].layers["0"].attention.wq
    assert torch.equal(again.lora_a.weight, wq.lora_a.weight)  # by (seed, FQN): whatever else is wrapped
    adapters = lora_state_dict(model)
    assert torch.equal(adapters["layers.0.attention.wq.lora_a.weight"], wq.lora_a.weight)
    assert len(adapters) == 2 * 2 * TINY.n_layers


ATTENTION = {"attention.wq", "attention.wk", "attention.wv", "attention.wo"}
FEED_FORWARD = {"feed_forward.w1", "feed_forward.w2", "feed_forward.w3"}


@pytest.mark.parametrize(
    "patterns, expected",
    [
        (["attention.*"], ATTENTION),
        (["w?"], ATTENTION | FEED_FORWARD),
        (["feed_forward.w1", "wv"], {"feed_forward.w1", "attention.wv"}),
        (["all-linear"], ATTENTION | FEED_FORWARD),
    ],
)
def test_target_patterns_match_name_suffixes(patterns, expected):
    with torch.device("meta"):
        model = get_family("llama3").model.model_cls(TINY)
    expected_fqns = {f"layers.{i}.{path}" for i in range(TINY.n_layers) for path in expected}
    assert set(lora_targets(model, patterns)) == expected_fqns
    assert lora_targets(model, ["layers.1.attention.wq"]) == ["layers.1.attention.wq"]
    assert lora_targets(model, ["output"]) == ["output"]


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("q_proj", "'q_proj' matches no module; valid: linear names output, w1, w2, w3, wk, wo, wq, wv, dotted"),
        ("attention_norm", "'attention_norm' matches layers.0.attention_norm, which is not a linear; valid: "),
    ],
)
def test_a_pattern_that_selects_no_linear_is_refused_in_one_line(pattern, message):
    with torch.device("meta"):
        model = get_family("llama3").model.model_cls(TINY)
    with pytest.raises(ConfigError, match="^" + re.escape(f"lora.target_modules: {message}")) as error:
        lora_targets(model, ["wq", pattern])
    assert "\n" not in str(error.value)


def test_routed_experts_are_refused_shared_experts_and_router_are_not():
    with torch.device("meta"):
        model = get_family("qwen3").model.model_cls(QWEN3_MOE)
    with pytest.raises(ConfigError, match=r"'experts' matches layers.0.moe.experts, routed experts held as grouped 3D"):
        lora_targets(model, ["experts"])
    assert lora_targets(model, ["gate"]) == ["layers.0.moe.router.gate", "layers.1.moe.router.gate"]


def test_lora_on_the_router_is_refused_under_tensor_parallel_only():
    settings = LoRA(enable=True, target_modules=["wq", "gate"])
    family = get_family("qwen3")
    check_lora_layout(settings, family, QWEN3_MOE, tensor_parallel_degree=1)
    with pytest.raises(ConfigError, match=r"^LoRA on layers.0.moe.router.gate cannot be expressed under tensor paral"):
        check_lora_layout(settings, family, QWEN3_MOE, tensor_parallel_degree=2)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("rank", 0, "lora.rank"),
        ("dropout", 1.0, r"lora.dropout must be in \[0, 1\); got 1"),
        ("target_modules", [], "lora.target_modules is empty"),
    ],
)
def test_bad_lora_keys_are_refused_by_the_config_check(key, value, message):
    cfg = JobConfig()
    cfg.lora.enable = True
    validate_config(cfg)
    setattr(cfg.lora, key, value)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


def test_lora_with_a_low_precision_converter_is_refused():
    cfg = JobConfig()
    cfg.lora.enable = True
    cfg.model.converters = ["float8"]
    with pytest.raises(ConfigError, match="^lora.enable does not compose with model.converters = float8"):
        validate_config(cfg)


def test_the_estimator_counts_gradients_and_moments_of_the_adapters_only():
    from dtrain.estimate.estimator import estimate
    from dtrain.estimate.hardware import load_hardware

    cfg = JobConfig()
    cfg.model.flavor = "debugmodel"
    full = estimate(cfg, 1, load_hardware("cpu")).stages[0].memory
    cfg.lora.enable = True
    lora = estimate(cfg, 1, load_hardware("cpu")).stages[0].memory
    with torch.device("meta"):
        model = get_family("llama3").model.model_cls(get_family("llama3").model.flavors["debugmodel"])
    apply_lora(model, cfg.lora)
    adapter_bytes = sum(4 * p.numel() for p in model.parameters() if p.requires_grad)
    assert lora.params == full.params + adapter_bytes
    assert lora.grads == adapter_bytes < full.grads / 10
    assert lora.optimizer < full.optimizer / 10


@pytest.mark.parametrize("key", ["tensor_parallel_degree", "context_parallel_degree"])
def test_adapter_dropout_is_refused_where_ranks_split_a_sequence(key):
    cfg = JobConfig()
    cfg.lora.enable, cfg.lora.dropout = True, 0.1
    validate_config(cfg)  # dropout with data parallel only: every rank draws its own masks
    setattr(cfg.parallelism, key, 2)
    with pytest.raises(ConfigError, match=f"^lora.dropout > 0 with parallelism.{key} = 2 is not built"):
        validate_config(cfg)


def test_lora_state_dict_holds_copies():
    _, model = lora_model(LoRA(enable=True, target_modules=["wq"]))
    adapters = lora_state_dict(model)
    with torch.no_grad():
        model.layers["0"].attention.wq.lora_b.weight.fill_(1.0)
    assert not adapters["layers.0.attention.wq.lora_b.weight"].any()
