"""The registered model families, by name: one line per family."""

from __future__ import annotations

from dtrain.parallelize.deepseek_v3 import DEEPSEEK_V3_SPEC
from dtrain.parallelize.family_spec import FamilySpec
from dtrain.parallelize.llama3 import LLAMA3_SPEC
from dtrain.parallelize.qwen3 import QWEN3_SPEC

FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in (LLAMA3_SPEC, QWEN3_SPEC, DEEPSEEK_V3_SPEC)}
# model.name when a config gives none.
DEFAULT_FAMILY = LLAMA3_SPEC.name


def get_family(name: str) -> FamilySpec:
    """The family registered as ``name``; ValueError listing the valid names otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r} (valid: {', '.join(sorted(FAMILIES))})")
    return FAMILIES[name]
