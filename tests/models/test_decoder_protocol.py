"""Every registered family keeps the decoder protocol that shared code relies on (models/decoder.py): its args give
each ``DecoderArgs`` field from its own fields, and its layout names modules its model has."""

from __future__ import annotations

import pytest
import torch

from dtrain.models.attention import CausalSDPA
from dtrain.models.decoder import DecoderArgs, decoder_layout
from dtrain.models.moe import MoEArgs
from dtrain.parallelize import FAMILIES

FIELDS = [name for name, value in vars(DecoderArgs).items() if isinstance(value, property)]


def test_the_protocol_lists_what_shared_code_reads():
    assert sorted(FIELDS) == sorted([
        "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden_dim", "vocab_size", "max_seq_len",
        "tie_word_embeddings", "moe",
    ])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_flavor_gives_every_field(name):
    for flavor, args in FAMILIES[name].model.flavors.items():
        for field in FIELDS:
            value = getattr(args, field)
            if field == "moe":
                assert value is None or isinstance(value, MoEArgs), (flavor, field)
            else:
                assert isinstance(value, bool if field == "tie_word_embeddings" else int), (flavor, field)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_layout_names_modules_the_model_has(name):
    family = FAMILIES[name].model
    args = family.flavors["debugmodel"]
    with torch.device("meta"):
        model = family.model_cls(args)
    layout = decoder_layout(model)
    blocks = layout.blocks_of(model)
    assert len(blocks) == args.n_layers
    for block in blocks.values():
        assert isinstance(getattr(layout.attention_of(block), layout.inner_attention), CausalSDPA)
    assert all(layout.part(model, part) is not None for part in layout.optional_parts)
