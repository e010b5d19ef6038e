"""PEFT's LoRA format: file names, tensor names and layouts of dtrain's LoRA adapters (dtrain/precision/lora.py).

A LoRALinear keeps its base linear's FQN and adds ``<module>.lora_a.weight`` (rank x in) and
``<module>.lora_b.weight`` (out x rank). PEFT names the same tensors after the Hugging Face module they adapt,
under its wrapper's prefix: ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``. The module's HF name
comes from the family's HF adapter (``hf_name`` of the base weight), and so does the layout: Llama's and Qwen3's
q/k projections store their output rows in another order in HF's files (the RoPE permutation), so lora_b's rows
(the adapter's output rows) are reordered exactly like the base weight's; lora_a (input columns) is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# PeftModel wraps the transformers model (base_model), whose LoraModel wraps it again (model).
PEFT_PREFIX = "base_model.model."
# Our LoRALinear's submodules and PEFT's names for them.
PEFT_PARTS = {"lora_a": "lora_A", "lora_b": "lora_B"}
_SUFFIXES = {f".{ours}.weight": ours for ours in PEFT_PARTS}


@dataclass(frozen=True)
class LoraTensor:
    """One LoRA tensor of ours: the adapted module's FQN and which of its two matrices."""

    module: str
    part: str  # "lora_a" or "lora_b"

    @property
    def base_weight(self) -> str:
        """The FQN of the frozen weight the adapter adds to (the HF adapter knows it)."""
        return f"{self.module}.weight"


def lora_tensor(fqn: str) -> LoraTensor | None:
    """The LoRA tensor `fqn` names, or None for any other parameter."""
    for suffix, part in _SUFFIXES.items():
        if fqn.endswith(suffix):
            return LoraTensor(fqn[: -len(suffix)], part)
    return None


def is_lora(fqn: str) -> bool:
    return lora_tensor(fqn) is not None


def hf_module(hf_adapter, module: str) -> str:
    """The Hugging Face module name of our module `module` (``model.layers.0.self_attn.q_proj``)."""
    if module == "output":
        # HF reads a tied head's weight from the embedding, but the module PEFT adapts is lm_head either way.
        return "lm_head"
    try:
        return hf_adapter.hf_name(f"{module}.weight").removesuffix(".weight")
    except ValueError:
        raise ValueError(f"{module} has no Hugging Face module that PEFT could adapt") from None


def peft_name(hf_adapter, tensor: LoraTensor) -> str:
    return f"{PEFT_PREFIX}{hf_module(hf_adapter, tensor.module)}.{PEFT_PARTS[tensor.part]}.weight"


def to_peft_layout(hf_adapter, tensor: LoraTensor, value: torch.Tensor) -> torch.Tensor:
    """Our `value` of `tensor` in PEFT's layout: lora_b's rows ordered like the HF base weight's rows."""
    if tensor.part == "lora_a":
        return value
    converted = hf_adapter.to_hf(tensor.base_weight, value)
    return value if converted is None else converted[1]  # None: a tied head, whose rows need no reordering


def from_peft_layout(hf_adapter, tensor: LoraTensor, value: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_peft_layout`."""
    return value if tensor.part == "lora_a" else hf_adapter.from_hf(tensor.base_weight, value)

