"""Tiny LoRA models of dtrain (Llama 3, Qwen3) with trained-looking adapters (nonzero lora_b), and their base
models as Hugging Face folders that transformers and PEFT load."""

from __future__ import annotations

from pathlib import Path

import torch
from checkpoint_helpers import FAMILY_ARGS, tiny_model

from dtrain.checkpoint.dcp_io import model_state_dict
from dtrain.checkpoint.hf_io import build_adapter, save_hf
from dtrain.checkpoint.peft_names import is_lora
from dtrain.config.schema import LoRA
from dtrain.parallelize import get_family
from dtrain.precision.lora import apply_lora

ATTENTION_AND_MLP = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]


def lora_settings(**changes) -> LoRA:
    """A [lora] section for the tiny models: rank 4, alpha 8 on attention and MLP, with `changes`."""
    return LoRA(**{"enable": True, "rank": 4, "alpha": 8.0, "target_modules": list(ATTENTION_AND_MLP), **changes})


def lora_model(family: str, lora: LoRA, seed: int = 0, args=None) -> torch.nn.Module:
    """The family's tiny model (or one of `args`) with LoRA applied and every adapter matrix random (lora_b is zero
    after init)."""
    torch.manual_seed(seed)
    model = tiny_model(family) if args is None else get_family(family).model.model_cls(args)
    apply_lora(model, lora)
    with torch.no_grad():
        for fqn, param in model.named_parameters():
            if is_lora(fqn):
                param.copy_(torch.randn_like(param) * 0.1)
    return model.eval()


def base_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {fqn: t for fqn, t in model_state_dict([model]).items() if not is_lora(fqn)}


def save_base_hf(model: torch.nn.Module, family: str, folder: Path) -> Path:
    """The LoRA model's frozen base as a HF folder (what a fine-tuning run starts from)."""
    save_hf(base_weights(model), folder, build_adapter(family, FAMILY_ARGS[family]), torch.float32)
    return folder

