"""A PEFT adapter folder as a run's starting adapters: dtrain -> PEFT -> dtrain is bit-exact, an adapter PEFT
itself trained and saved gives PEFT's logits in dtrain (lm_head's saved whole weight included), and an adapter
the run could not continue (or not finite) is refused in one line naming what differs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from checkpoint_helpers import FAMILY_ARGS, tiny_model
from peft_helpers import ATTENTION_AND_MLP, lora_model, lora_settings, save_base_hf

from dtrain.checkpoint.dcp_io import model_state_dict
from dtrain.checkpoint.hf_io import build_adapter
from dtrain.checkpoint.peft_export import save_peft_adapter
from dtrain.checkpoint.peft_import import load_peft_adapter
from dtrain.checkpoint.peft_names import is_lora
from dtrain.errors import DtrainError

HF_ADAPTER = build_adapter("llama3", FAMILY_ARGS["llama3"])


def lora_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {fqn: t for fqn, t in model_state_dict([model]).items() if is_lora(fqn)}


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_dtrain_to_peft_to_dtrain_is_bit_exact(tmp_path, family):
    lora = lora_settings()
    source = lora_model(family, lora, seed=0)
    save_peft_adapter(model_state_dict([source]), tmp_path, build_adapter(family, FAMILY_ARGS[family]), lora,
                      torch.float32)
    target = lora_model(family, lora, seed=1)
    assert not torch.equal(*(next(iter(lora_tensors(m).values())) for m in (source, target)))
    load_peft_adapter([target], tmp_path, lora, build_adapter(family, FAMILY_ARGS[family]))
    for fqn, value in lora_tensors(source).items():
        assert torch.equal(value, lora_tensors(target)[fqn]), fqn


def saved_by_peft(tmp_path, model: torch.nn.Module, targets: list[str], alpha: int = 16):
    """(PEFT's model, the folder it saved) of a rank-4 adapter PEFT made on `targets` of the transformers form of
    dtrain's `model`'s base, with PEFT's default saving, after some training (lora_B nonzero)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base_dir = save_base_hf(model, "llama3", tmp_path / "base")
    base = transformers.LlamaForCausalLM.from_pretrained(str(base_dir), attn_implementation="eager").eval()
    theirs = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=alpha, task_type="CAUSAL_LM",
                                                       target_modules=targets))
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:  # PEFT starts B at zero
                param.copy_(torch.randn_like(param) * 0.1)
    theirs.save_pretrained(str(tmp_path / "adapter"))
    return theirs.eval(), tmp_path / "adapter"


@pytest.mark.parametrize("theirs, ours", [
    (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], ATTENTION_AND_MLP),
    (["q_proj", "lm_head"], ["wq", "output"]),  # PEFT saves lm_head's whole weight beside its adapter
])
def test_an_adapter_peft_saved_gives_peft_logits_in_dtrain(tmp_path, theirs, ours):
    lora = lora_settings(rank=4, alpha=16.0, target_modules=ours)
    model = lora_model("llama3", lora)
    peft_model, adapter = saved_by_peft(tmp_path, model, theirs)
    load_peft_adapter([model], adapter, lora, HF_ADAPTER)
    tokens = torch.randint(0, FAMILY_ARGS["llama3"].vocab_size, (2, 24))
    with torch.no_grad():
        assert (model(tokens) - peft_model(input_ids=tokens).logits).abs().max() < 1e-5


def test_an_adapter_on_another_head_or_on_the_embedding_is_refused(tmp_path):
    lora = lora_settings(rank=4, alpha=16.0, target_modules=["wq", "output"])
    model = lora_model("llama3", lora)
    _, adapter = saved_by_peft(tmp_path / "head", model, ["q_proj", "lm_head"])
    with torch.no_grad():
        model.output.weight.add_(1e-3)  # a base whose head another fine-tune changed
    with pytest.raises(DtrainError) as err:
        load_peft_adapter([model], adapter, lora, HF_ADAPTER)
    assert str(err.value) == (
        f"lora.initial_adapter_path {adapter}: adapter_model.safetensors holds base_model.model.lm_head.base_layer."
        "weight, the base weight PEFT saves beside an adapter on lm_head, and it differs from this run's "
        "output.weight: the adapter was trained on another base model than checkpoint.initial_load_path"
    )
    _, adapter = saved_by_peft(tmp_path / "embedding", model, ["q_proj", "embed_tokens"])
    with pytest.raises(DtrainError, match=r"adapts model\.embed_tokens, which this run's lora.target_modules = "
                                          r"\[wq, output\] do not adapt"):
        load_peft_adapter([model], adapter, lora, HF_ADAPTER)


@pytest.fixture
def adapter_dir(tmp_path):
    """A Llama 3 adapter of [lora] defaults, with its base model's folder named in adapter_config.json."""
    lora = lora_settings()
    model = lora_model("llama3", lora)
    base_dir = save_base_hf(model, "llama3", tmp_path / "base")
    save_peft_adapter(model_state_dict([model]), tmp_path / "adapter", HF_ADAPTER, lora, torch.float32,
                      base_model_name_or_path=str(base_dir))
    return tmp_path / "adapter"


@pytest.mark.parametrize("lora, message", [
    (lora_settings(rank=8), r"r = 4, this run has lora.rank = 8; set lora.rank = 4"),
    (lora_settings(alpha=16.0), r"lora_alpha = 8.0, this run has lora.alpha = 16.0"),
    (lora_settings(use_rslora=True), r"use_rslora = False, this run has lora.use_rslora = True"),
    (lora_settings(target_modules=["wq", "wk", "wv", "wo"]),
     r"adapts model.layers.0.mlp.down_proj \(and 5 more modules\), which this run's lora.target_modules = "
     r"\[wq, wk, wv, wo\] do not adapt"),
    (lora_settings(target_modules=[*ATTENTION_AND_MLP, "output"]),
     r"has no adapter for lm_head, which this run's lora.target_modules = \[wq, .*, output\] adapt"),
])
def test_an_adapter_the_run_cannot_continue_is_refused(adapter_dir, lora, message):
    with pytest.raises(DtrainError, match=message):
        load_peft_adapter([lora_model("llama3", lora)], adapter_dir, lora, HF_ADAPTER)


def test_an_adapter_of_another_base_model_is_refused(adapter_dir, tmp_path):
    lora = lora_settings()
    wider = replace(FAMILY_ARGS["llama3"], dim=96)
    model = tiny_model("llama3")
    with pytest.raises(DtrainError, match=r"was trained on base model .*base, which has dim = 64, this model has 96"):
        load_peft_adapter([model], adapter_dir, lora, build_adapter("llama3", wider))
    # Without its base model's folder at hand, the tensors' shapes tell.
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (adapter_dir / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/name"}))
    other = lora_model("llama3", lora, args=wider)
    with pytest.raises(DtrainError, match=r"q_proj.lora_A.weight has shape \[4, 64\], this model's "
                                          r"layers.0.attention.wq.lora_a.weight has \[4, 96\] \(the adapter's base"):
        load_peft_adapter([other], adapter_dir, lora, build_adapter("llama3", wider))


def test_a_non_finite_adapter_is_refused_naming_file_and_tensor(adapter_dir):
    from safetensors.torch import load_file, save_file

    file = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(str(file))
    name = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    tensors[name][2, 0] = float("inf")
    save_file(tensors, str(file))
    with pytest.raises(DtrainError) as err:
        load_peft_adapter([lora_model("llama3", lora_settings())], adapter_dir, lora_settings(), HF_ADAPTER)
    assert str(err.value) == (f"lora.initial_adapter_path {adapter_dir}: adapter_model.safetensors holds NaN or Inf "
                              f"values in {name}; an adapter to start from must be finite (was it saved from a "
                              "diverged run, or damaged?)")


def test_what_dtrain_lora_does_not_express_is_refused(adapter_dir, tmp_path):
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (adapter_dir / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    model = lora_model("llama3", lora_settings())
    with pytest.raises(DtrainError, match=r"adapter_config.json has use_dora = True, which dtrain's LoRA does not "
                                          r"express \(valid: False\)"):
        load_peft_adapter([model], adapter_dir, lora_settings(), HF_ADAPTER)
    with pytest.raises(DtrainError, match=r"lora.initial_adapter_path .* is not a PEFT adapter folder"):
        load_peft_adapter([model], tmp_path / "nowhere", lora_settings(), HF_ADAPTER)


@pytest.mark.parametrize("lora, checkpoint, message", [
    ({}, {"initial_load_path": "."}, r"lora.initial_adapter_path .* needs lora.enable = true"),
    ({"enable": True}, {}, r"lora.initial_adapter_path .* adapts a base model: set checkpoint.initial_load_path"),
    ({"enable": True}, {"initial_load_path": "."}, r"lora.initial_adapter_path .*nowhere is not a PEFT adapter folder"),
])
def test_the_config_is_refused_before_the_run_starts(tmp_path, lora, checkpoint, message):
    from dtrain.config import JobConfig, validate_config
    from dtrain.errors import ConfigError

    cfg = JobConfig()
    for key, value in {**lora, "initial_adapter_path": str(tmp_path / "nowhere")}.items():
        setattr(cfg.lora, key, value)
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


def test_a_pipeline_stage_loads_its_own_adapters(tmp_path):
    lora = lora_settings()
    source = lora_model("llama3", lora, seed=0)
    save_peft_adapter(model_state_dict([source]), tmp_path, HF_ADAPTER, lora, torch.float32)
    whole_model = [fqn for fqn in model_state_dict([source]) if is_lora(fqn)]
    stage = lora_model("llama3", lora, seed=1)
    del stage.layers["1"]  # the first stage of two: its rank holds block 0 only
    with pytest.raises(DtrainError, match=r"adapts model.layers.1.mlp.down_proj \(and 6 more modules\)"):
        load_peft_adapter([stage], tmp_path, lora, HF_ADAPTER)  # as if the stage were the whole model
    load_peft_adapter([stage], tmp_path, lora, HF_ADAPTER, whole_model)
    for fqn, value in lora_tensors(stage).items():
        assert torch.equal(value, lora_tensors(source)[fqn]), fqn
    assert lora_tensors(stage) and all(fqn.startswith("layers.0.") for fqn in lora_tensors(stage))
