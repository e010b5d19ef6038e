"""A PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) as the starting adapters
of a run (lora.initial_adapter_path): its settings and tensors are checked against the run's [lora] section and
model first, each mismatch (and a NaN or Inf) refused in one line, then every adapter tensor is loaded into this
rank's shards the way hf_io loads Hugging Face weights (each rank reads the whole tensor and keeps its own part).

PEFT saves the whole base weight of an adapted lm_head or embed_tokens beside its adapter by default
(``<module>.base_layer.weight``, save_embedding_layers="auto"): the run's base already holds that weight, so it is
not loaded but must equal the base's (an adapter trained on another base is refused).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtrain.checkpoint.dcp_io import model_state_dict, place_like, set_model_weights
from dtrain.checkpoint.hf_io import read_hf_config
from dtrain.checkpoint.peft_names import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    PEFT_PREFIX,
    from_peft_layout,
    hf_module,
    lora_tensor,
    peft_name,
)
from dtrain.errors import DtrainError

KEY = "lora.initial_adapter_path"
# The suffix of a whole base weight PEFT saved beside the adapter of its module.
BASE_LAYER = ".base_layer.weight"


def read_adapter_config(path: Path) -> dict[str, Any]:
    file = path / ADAPTER_CONFIG_FILE
    if not path.is_dir() or not file.is_file():
        raise DtrainError(f"{KEY} {path} is not a PEFT adapter folder (no {ADAPTER_CONFIG_FILE})")
    try:
        return json.loads(file.read_text())
    except ValueError as err:
        raise DtrainError(f"{file} is not valid JSON ({err})") from None


def read_adapter_tensors(path: Path) -> dict[str, torch.Tensor]:
    """{PEFT name: tensor} of the adapter folder's safetensors (never a pickled adapter_model.bin)."""
    from safetensors.torch import load_file

    file = path / ADAPTER_WEIGHTS_FILE
    if not file.is_file():
        raise DtrainError(f"{KEY} {path} has no {ADAPTER_WEIGHTS_FILE} (only safetensors adapters are read)")
    try:
        return load_file(str(file))
    except Exception as err:  # safetensors raises its own error types for torn or foreign files
        raise DtrainError(f"{file} is not a readable safetensors file ({err})") from None


def check_adapter_config(path: Path, config: dict[str, Any], lora, hf_adapter) -> None:
    """Refuse, in one line, an adapter this run's [lora] settings or model could not continue exactly."""
    where = f"{KEY} {path}: {ADAPTER_CONFIG_FILE}"
    if config.get("peft_type") != "LORA":
        raise DtrainError(f"{where} has peft_type = {config.get('peft_type')!r}; only LORA adapters load")
    unsupported = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "lora_bias": False,
                   "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None}
    for key, plain in unsupported.items():
        if config.get(key, plain) not in (plain, None):
            raise DtrainError(f"{where} has {key} = {config[key]!r}, which dtrain's LoRA does not express "
                              f"(valid: {plain!r})")
    for theirs, ours in (("r", "rank"), ("lora_alpha", "alpha"), ("use_rslora", "use_rslora")):
        if config.get(theirs, False) != getattr(lora, ours):
            raise DtrainError(f"{where} has {theirs} = {config.get(theirs)!r}, this run has lora.{ours} = "
                              f"{getattr(lora, ours)!r}; set lora.{ours} = {config.get(theirs)!r}")
    base = config.get("base_model_name_or_path")
    base_config = read_hf_config(Path(base)) if base and Path(base).is_dir() else None
    if base_config is not None:
        try:
            hf_adapter.check_hf_config(base_config)
        except ValueError as err:
            raise DtrainError(f"{KEY} {path} was trained on base model {base}, which {err}") from None


def adapter_weights_for(path: Path, tensors: dict[str, torch.Tensor], targets: dict[str, torch.Tensor],
                        hf_adapter, whole_model: list[str], lora) -> dict[str, torch.Tensor]:
    """{our FQN: whole tensor in our layout} for every LoRA tensor of this rank's model parts (`targets`), from the
    adapter's `tensors`; refuses adapters for modules the whole model (`whole_model`: every LoRA FQN of all
    pipeline stages) does not adapt, missing ones and other shapes, naming the first."""
    names = {fqn: peft_name(hf_adapter, lora_tensor(fqn)) for fqn in targets}
    ours = f"this run's lora.target_modules = [{', '.join(lora.target_modules)}]"
    extra = _modules(set(tensors) - {peft_name(hf_adapter, lora_tensor(fqn)) for fqn in whole_model}
                     - set(saved_base_weights(tensors, hf_adapter, whole_model)))
    if extra:
        raise DtrainError(f"{KEY} {path} adapts {_first_of(extra)}, which {ours} do not adapt")
    missing = _modules({name for name in names.values() if name not in tensors})
    if missing:
        raise DtrainError(f"{KEY} {path} has no adapter for {_first_of(missing)}, which {ours} adapt")
    weights = {}
    for fqn, target in targets.items():
        value = tensors[names[fqn]]
        if tuple(value.shape) != tuple(target.shape):
            raise DtrainError(f"{KEY} {path}: {names[fqn]} has shape {list(value.shape)}, this model's {fqn} has "
                              f"{list(target.shape)} (the adapter's base model differs from this run's)")
        weights[fqn] = from_peft_layout(hf_adapter, lora_tensor(fqn), value)
    return weights


def peft_module(name: str) -> str:
    """The HF module (model.layers.0.self_attn.q_proj) a PEFT tensor name belongs to: its name without the wrapper's
    prefix, the ``.weight`` and the adapter's part (``lora_A``, ``lora_embedding_B``, ``base_layer``, ...)."""
    parts = name.removeprefix(PEFT_PREFIX).removesuffix(".weight").split(".")
    if len(parts) > 1 and (parts[-1].startswith("lora_") or parts[-1] == "base_layer"):
        parts.pop()
    return ".".join(parts)


def saved_base_weights(tensors: dict[str, torch.Tensor], hf_adapter, whole_model: list[str]) -> dict[str, str]:
    """{PEFT name: our FQN} of the whole base weights PEFT saved beside the adapters of modules the run adapts."""
    adapted = {hf_module(hf_adapter, t.module): t.module for t in map(lora_tensor, whole_model)}
    return {name: f"{adapted[peft_module(name)]}.weight" for name in tensors
            if name.endswith(BASE_LAYER) and peft_module(name) in adapted}


def check_saved_base_weights(path: Path, tensors: dict[str, torch.Tensor], base: dict[str, torch.Tensor], hf_adapter,
                             whole_model: list[str]) -> None:
    """Refuse a base weight saved beside the adapter that differs from this run's (`base`: this rank's weights)."""
    for name, fqn in sorted(saved_base_weights(tensors, hf_adapter, whole_model).items()):
        if fqn not in base:  # another pipeline stage's
            continue
        ours = base[fqn].full_tensor() if isinstance(base[fqn], DTensor) else base[fqn]
        saved = hf_adapter.from_hf(fqn, tensors[name])
        if tuple(saved.shape) != tuple(ours.shape) or not torch.equal(saved.to(ours.dtype), ours):
            raise DtrainError(
                f"{KEY} {path}: {ADAPTER_WEIGHTS_FILE} holds {name}, the base weight PEFT saves beside an adapter on "
                f"{peft_module(name)}, and it differs from this run's {fqn}: the adapter was trained on another base "
                "model than checkpoint.initial_load_path"
            )


def check_finite(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse an adapter file with a NaN or Inf in any tensor (every rank reads all of them, so all refuse alike)."""
    bad = next((name for name in sorted(tensors) if not torch.isfinite(tensors[name]).all()), None)
    if bad is not None:
        raise DtrainError(f"{KEY} {path}: {ADAPTER_WEIGHTS_FILE} holds NaN or Inf values in {bad}; an adapter to "
                          "start from must be finite (was it saved from a diverged run, or damaged?)")


def _modules(names: set[str]) -> list[str]:
    """The HF modules (model.layers.0.self_attn.q_proj) of PEFT tensor names, sorted."""
    return sorted({peft_module(name) for name in names})


def _first_of(modules: list[str]) -> str:
    return modules[0] + (f" (and {len(modules) - 1} more modules)" if len(modules) > 1 else "")


def load_peft_adapter(model_parts: list[nn.Module], path: Path, lora, hf_adapter,
                      whole_model: list[str] | None = None) -> None:
    """Load the PEFT adapter at `path` into the LoRA tensors of the (possibly sharded) model parts; `whole_model`:
    the LoRA FQNs of every pipeline stage, where these parts are only some stages."""
    check_adapter_config(path, read_adapter_config(path), lora, hf_adapter)
    targets = {fqn: t for fqn, t in model_state_dict(model_parts).items() if lora_tensor(fqn) is not None}
    if not targets:
        raise DtrainError(f"{KEY} is set, but this model has no LoRA adapters to load it into (set [lora])")
    tensors = read_adapter_tensors(path)
    check_finite(path, tensors)
    whole_model = whole_model or list(targets)
    weights = adapter_weights_for(path, tensors, targets, hf_adapter, whole_model, lora)
    check_saved_base_weights(path, tensors, model_state_dict(model_parts), hf_adapter, whole_model)
    set_model_weights(model_parts, {fqn: place_like(weights[fqn], targets[fqn]) for fqn in targets})
