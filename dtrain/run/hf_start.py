"""Starting from a Hugging Face checkpoint: its config.json decides the model family and shape.

With ``checkpoint.initial_load_in_hf`` and a folder that holds a config.json, the run needs no flavor: the family
comes from the config's ``architectures`` (or ``model_type``) and the shape (layers, heads, widths, RoPE and its
scaling, tying, vocabulary) from the rest. A ``model.name`` or ``[model.args]`` value that contradicts it is
refused in one line rather than loaded into the wrong model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.checkpoint.hf_io import CONFIG_FILE, read_hf_config
from dtrain.config.schema import Checkpoint, Model
from dtrain.errors import ConfigError, DtrainError
from dtrain.models.decoder import DecoderArgs
from dtrain.parallelize import FAMILIES, FamilySpec


@dataclass(frozen=True)
class HFStart:
    """The family and shape a Hugging Face config.json describes, and where it was read (for messages)."""

    family: FamilySpec
    args: DecoderArgs
    source: str


def _kinds(adapter) -> tuple[tuple[str, str], ...]:
    """Every (architecture, model_type) whose config.json a family's adapter reads."""
    return ((adapter.HF_ARCHITECTURE, adapter.HF_MODEL_TYPE), *adapter.HF_OTHER_KINDS)


def family_of(config: dict[str, Any], source: str) -> FamilySpec:
    """The family that reads a config.json (by its architecture, else its model_type); ConfigError naming `source`
    and the valid ones otherwise."""
    architecture, model_type = (config.get("architectures") or [None])[0], config.get("model_type")
    for spec in FAMILIES.values():
        for kind_architecture, kind_model_type in _kinds(spec.model.hf_adapter):
            if architecture == kind_architecture or (architecture is None and model_type == kind_model_type):
                return spec
    known = ", ".join(kind[0] for spec in FAMILIES.values() for kind in _kinds(spec.model.hf_adapter))
    described = architecture or model_type or "no architecture"
    raise ConfigError(f"{source} describes {described}, which no model family reads (valid: {known})")


def hf_start(c: Checkpoint, model_name: str) -> HFStart | None:
    """The family and shape of the HF checkpoint `[checkpoint]` starts from, or None when it starts otherwise (or
    the folder has no config.json, in which case the flavor decides, as before); `model_name` (`model.name`) may
    only agree with it."""
    if not (c.initial_load_in_hf and c.initial_load_path):
        return None
    path = Path(c.initial_load_path)
    try:
        config = read_hf_config(path)
    except DtrainError as err:
        raise ConfigError(str(err)) from None
    if config is None:
        return None
    source = str((path if path.is_dir() else path.parent) / CONFIG_FILE)
    family = family_of(config, source)
    if model_name not in (Model().name, family.name):
        raise ConfigError(f"model.name={model_name} contradicts {source}, a {family.name} model")
    try:
        args = family.model.hf_adapter.args_from_hf_config(config)
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"{source} is not a readable {family.name} config ({type(err).__name__}: {err})") from None
    return HFStart(family, args, source)
