"""LoRA adapters exported in PEFT's format load with `peft.PeftModel.from_pretrained` onto the transformers base
model and give dtrain's logits (fp32, 1e-5); the merged export loads into transformers with the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_helpers import FAMILY_ARGS
from peft_helpers import lora_model, lora_settings, save_base_hf

from dtrain.checkpoint.dcp_io import model_state_dict
from dtrain.checkpoint.hf_io import build_adapter
from dtrain.checkpoint.peft_export import peft_target_modules, save_merged_hf, save_peft_adapter
from dtrain.errors import DtrainError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

HF_CLASSES = {"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ATOL = 1e-5


def hf_model(family: str, folder):
    cls = getattr(transformers, HF_CLASSES[family])
    return cls.from_pretrained(str(folder), attn_implementation="eager", dtype=torch.float32).eval()


def max_diff(ours: torch.nn.Module, theirs: torch.nn.Module, vocab: int) -> float:
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return (ours(tokens) - theirs(input_ids=tokens).logits).abs().max().item()


@pytest.mark.parametrize("family, lora", [
    ("llama3", lora_settings()),
    ("qwen3", lora_settings(rank=8, alpha=4.0, use_rslora=True)),
    ("llama3", lora_settings(target_modules=["wq", "wk"], use_rslora=True)),
])
def test_peft_loads_the_exported_adapter_with_dtrain_logits(tmp_path, family, lora):
    model = lora_model(family, lora)
    hf_adapter = build_adapter(family, FAMILY_ARGS[family])
    base_dir = save_base_hf(model, family, tmp_path / "base")
    save_peft_adapter(model_state_dict([model]), tmp_path / "adapter", hf_adapter, lora, torch.float32,
                      base_model_name_or_path=str(base_dir))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == lora.rank and config["base_model_name_or_path"]

    base = hf_model(family, base_dir)
    vocab = FAMILY_ARGS[family].vocab_size
    assert max_diff(model, base, vocab) > 1e-2  # the adapters matter
    theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    loaded = {name for name, _ in theirs.named_parameters() if "lora_" in name}
    assert len(loaded) == 2 * FAMILY_ARGS[family].n_layers * len(lora.target_modules)  # none missing, none extra
    assert max_diff(model, theirs, vocab) < ATOL


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_transformers_loads_the_merged_model_with_dtrain_logits(tmp_path, family):
    lora = lora_settings()
    model = lora_model(family, lora)
    hf_adapter = build_adapter(family, FAMILY_ARGS[family])
    save_merged_hf(model_state_dict([model]), tmp_path / "merged", hf_adapter, lora, torch.float32)
    assert max_diff(model, hf_model(family, tmp_path / "merged"), FAMILY_ARGS[family].vocab_size) < ATOL


def test_target_modules_name_leaves_or_the_exact_modules():
    lora = lora_settings(target_modules=["wq", "w2"])
    model = lora_model("llama3", lora)
    weights = model_state_dict([model])
    hf_adapter = build_adapter("llama3", FAMILY_ARGS["llama3"])
    assert peft_target_modules(weights, hf_adapter) == ["down_proj", "q_proj"]
    # Adapters on one layer only: the leaf names would make PEFT adapt layer 1 too, so the modules are named.
    first_layer = {k: v for k, v in weights.items() if ".lora_" not in k or k.startswith("layers.0.")}
    assert peft_target_modules(first_layer, hf_adapter) == (
        r"(model\.layers\.0\.mlp\.down_proj|model\.layers\.0\.self_attn\.q_proj)"
    )


def test_an_adapter_on_a_tied_head_is_not_merged(tmp_path):
    lora = lora_settings(target_modules=["wq", "output"])
    model = lora_model("qwen3", lora)  # Qwen3's tiny model ties its head to the embedding
    with pytest.raises(DtrainError, match="an adapter on a tied output head cannot be merged"):
        save_merged_hf(model_state_dict([model]), tmp_path, build_adapter("qwen3", FAMILY_ARGS["qwen3"]), lora,
                       torch.float32)
    # ... while PEFT adapts lm_head, tied or not, with the same logits.
    hf_adapter = build_adapter("qwen3", FAMILY_ARGS["qwen3"])
    base_dir = save_base_hf(model, "qwen3", tmp_path / "base")
    save_peft_adapter(model_state_dict([model]), tmp_path / "adapter", hf_adapter, lora, torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf_model("qwen3", base_dir), str(tmp_path / "adapter")).eval()
    assert max_diff(model, theirs, FAMILY_ARGS["qwen3"].vocab_size) < ATOL
