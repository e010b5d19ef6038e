"""A LoRA model's weights out as Hugging Face folders: the adapters in PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained`` loads onto the transformers base model),
or the merged model (base + scaling * B @ A) as a plain HF folder that transformers loads.

Both take full (unsharded) weights by our FQN, as ``lora_run_weights`` reads them from a LoRA run's checkpoint
(the frozen base of an adapter-only one from where the run read it), and the run's ``[lora]`` section (rank, alpha,
dropout, use_rslora): the scaling comes from it, as training's does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from dtrain.checkpoint.export_folder import export_mark
from dtrain.checkpoint.hf_io import save_hf
from dtrain.checkpoint.peft_names import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    hf_module,
    lora_tensor,
    peft_name,
    to_peft_layout,
)
from dtrain.errors import DtrainError
from dtrain.precision.lora import lora_scaling


def adapted_modules(weights: dict[str, torch.Tensor]) -> list[str]:
    """Our FQNs of the modules that carry LoRA adapters, in the weights' order."""
    modules = [t.module for t in map(lora_tensor, weights) if t is not None and t.part == "lora_a"]
    if not modules:
        raise DtrainError("the weights hold no LoRA adapters (no *.lora_a.weight): not a LoRA run's checkpoint")
    return modules


def peft_target_modules(weights: dict[str, torch.Tensor], hf_adapter) -> list[str] | str:
    """PEFT's target_modules for exactly the adapted modules: their HF leaf names (q_proj, ...) where those name
    no other module of the model, else a regular expression that PEFT full-matches against each module's name."""
    adapted = {hf_module(hf_adapter, m) for m in adapted_modules(weights)}
    leaves = {name.rsplit(".", 1)[-1] for name in adapted}
    same_leaf = set()
    for fqn, value in weights.items():
        if lora_tensor(fqn) is None and fqn.endswith(".weight") and value.ndim == 2:
            try:
                name = hf_module(hf_adapter, fqn.removesuffix(".weight"))
            except ValueError:  # a tensor without its own HF module (none PEFT could target)
                continue
            if name.rsplit(".", 1)[-1] in leaves:
                same_leaf.add(name)
    if same_leaf == adapted:
        return sorted(leaves)
    return "(" + "|".join(re.escape(name) for name in sorted(adapted)) + ")"


def peft_adapter_config(lora, target_modules: list[str] | str, base_model_name_or_path: str | None) -> dict[str, Any]:
    """adapter_config.json of a LoRA adapter trained with the `lora` settings ([lora])."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "use_rslora": lora.use_rslora,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,  # HF's linears store (out, in), as ours do
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
        "lora_bias": False,
    }


def save_peft_adapter(
    weights: dict[str, torch.Tensor], out_dir: Path, hf_adapter, lora, dtype: torch.dtype,
    base_model_name_or_path: str | None = None,
) -> list[Path]:
    """Write the adapters among `weights` as a PEFT adapter folder; returns the files written."""
    from safetensors.torch import save_file

    tensors = {}
    for fqn, value in weights.items():
        tensor = lora_tensor(fqn)
        if tensor is not None:
            tensors[peft_name(hf_adapter, tensor)] = to_peft_layout(hf_adapter, tensor, value).to(dtype).contiguous()
    config = peft_adapter_config(lora, peft_target_modules(weights, hf_adapter), base_model_name_or_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS_FILE), metadata=export_mark("peft"))
    (out_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return [out_dir / ADAPTER_WEIGHTS_FILE, out_dir / ADAPTER_CONFIG_FILE]


def merged_weights(weights: dict[str, torch.Tensor], lora) -> dict[str, torch.Tensor]:
    """The model's weights with every adapter folded into its base weight (W + scaling * B @ A, in float32) and
    the adapters dropped: the weights of a plain model that computes what the LoRA model computes."""
    scaling = lora_scaling(lora.rank, lora.alpha, lora.use_rslora)
    merged = {fqn: value for fqn, value in weights.items() if lora_tensor(fqn) is None}
    for module in adapted_modules(weights):
        base = weights[f"{module}.weight"]
        delta = weights[f"{module}.lora_b.weight"].float() @ weights[f"{module}.lora_a.weight"].float()
        merged[f"{module}.weight"] = (base.float() + scaling * delta).to(base.dtype)
    return merged


def save_merged_hf(
    weights: dict[str, torch.Tensor], out_dir: Path, hf_adapter, lora, dtype: torch.dtype,
    special_tokens: dict[str, Any] | None = None, max_shard_bytes: int = 5 << 30,
) -> list[Path]:
    """Write the merged model (``merged_weights``) as a Hugging Face folder; returns the files written."""
    if getattr(hf_adapter.args, "tie_word_embeddings", False) and "output" in adapted_modules(weights):
        # The head's update would have to change the embedding it shares its weight with.
        raise DtrainError("an adapter on a tied output head cannot be merged into the weights (the head is the "
                          "embedding's weight); export the adapters with to-peft instead")
    return save_hf(merged_weights(weights, lora), out_dir, hf_adapter, dtype, max_shard_bytes, special_tokens)


def lora_run_weights(checkpoint: Path, hf_adapter, base_fqns: list[str]) -> dict[str, torch.Tensor]:
    """Every weight of a LoRA run at DCP `checkpoint` as a whole tensor by our FQN: an adapter-only checkpoint's
    adapters with its frozen base (`base_fqns`) read from the base it refers to (checked first: lora_base.py)."""
    from dtrain.checkpoint.dcp_io import read_full_weights
    from dtrain.checkpoint.folders import read_record
    from dtrain.checkpoint.hf_io import iter_hf_weights
    from dtrain.checkpoint.lora_base import check_base_reference

    weights = read_full_weights(checkpoint)
    base = read_record(checkpoint).lora.get("base")
    if base is None:  # the checkpoint holds its base itself
        return weights
    path = check_base_reference(checkpoint, base)
    frozen = dict(iter_hf_weights(path, hf_adapter, base_fqns)) if base["in_hf"] else read_full_weights(path)
    return {**{fqn: t for fqn, t in frozen.items() if fqn in base_fqns}, **weights}
