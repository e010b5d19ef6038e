"""The config's copy of the family facts (dtrain/config/model_families.py) matches the family registry."""

from __future__ import annotations

from dtrain.config.model_families import DEFAULT_MODEL_FAMILY, MODEL_FAMILIES, SPLIT_EXAMPLE_STAGES
from dtrain.parallelize.families import DEFAULT_FAMILY, FAMILIES


def test_model_name_choices_are_the_registered_families():
    assert MODEL_FAMILIES == tuple(FAMILIES)
    assert DEFAULT_MODEL_FAMILY == DEFAULT_FAMILY


def test_split_example_uses_the_default_familys_module_names():
    layout = FAMILIES[DEFAULT_FAMILY].model.model_cls.decoder_layout
    expected = ((layout.embedding, layout.block(0)), (layout.block(1), layout.final_norm, layout.head))
    assert SPLIT_EXAMPLE_STAGES == expected
