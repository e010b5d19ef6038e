"""Flavors reproduce the published Llama 3.1/3.2 shapes, and the family registry hands them to the trainer."""

from dataclasses import replace

import pytest
import torch

from dtrain.models import count_params
from dtrain.models.llama3 import LLAMA3, Llama3HFAdapter
from dtrain.parallelize import FAMILIES, get_family
from dtrain.models.llama3 import LLAMA3_FLAVORS, Llama3Args, RopeScaling, Transformer


def _meta_model(args: Llama3Args) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


@pytest.mark.parametrize(
    "flavor, ffn_hidden",
    [("1B", 8192), ("3B", 8192), ("8B", 14336), ("70B", 28672), ("405B", 53248), ("debugmodel", 768)],
)
def test_ffn_hidden_sizes(flavor, ffn_hidden):
    assert LLAMA3_FLAVORS[flavor].ffn_hidden_dim == ffn_hidden


@pytest.mark.parametrize(
    "flavor, published",
    [
        ("8B", 8_030_261_248),
        ("70B", 70_553_706_496),
        ("405B", 405_853_388_800),
        ("1B", 1_235_814_400),
        ("3B", 3_212_749_824),
    ],
)
def test_parameter_counts_match_published(flavor, published):
    args = LLAMA3_FLAVORS[flavor]
    assert args.vocab_size == 128256
    model = _meta_model(args)
    assert all(p.is_meta for p in model.parameters())
    assert count_params(model) == published


def test_rope_scaling_per_release():
    for flavor in ("8B", "70B", "405B"):
        assert LLAMA3_FLAVORS[flavor].rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
        assert not LLAMA3_FLAVORS[flavor].tie_word_embeddings
    for flavor in ("1B", "3B"):
        assert LLAMA3_FLAVORS[flavor].rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
        assert LLAMA3_FLAVORS[flavor].tie_word_embeddings
    assert all(args.rope_theta == 500000.0 for args in LLAMA3_FLAVORS.values())


def test_debugmodels_are_small_torchtitans_with_mha_and_ours_with_gqa():
    # torchtitan 0.2.2's shape (tests/reference/test_torchtitan_flavors.py compares every field), and dtrain's
    # own, which the default run (train_configs/debug_model.toml) trains so that it exercises grouped-query attention.
    shapes = {"debugmodel": (256, 6, 16, 16), "debugmodel_gqa": (256, 6, 8, 4)}
    for flavor, shape in shapes.items():
        args = LLAMA3_FLAVORS[flavor]
        assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == shape
        assert args.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
        assert count_params(_meta_model(args)) < 10_000_000


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"dim": 100, "n_heads": 8}, "n_heads"),
        ({"n_heads": 8, "n_kv_heads": 3}, "n_kv_heads"),
        ({"dim": 24, "n_heads": 8, "n_kv_heads": 8}, "head_dim"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_invalid_args_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        replace(LLAMA3_FLAVORS["debugmodel"], **overrides)


def test_invalid_rope_scaling():
    with pytest.raises(ValueError, match="high_freq_factor"):
        RopeScaling(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)


def test_registry_builds_what_the_trainer_asks_for():
    spec = get_family("llama3")
    assert FAMILIES["llama3"] is spec and spec.model is LLAMA3
    family = spec.model
    assert family.args_cls is Llama3Args and family.flavors is LLAMA3_FLAVORS and family.hf_adapter is Llama3HFAdapter
    args = replace(family.flavors["8B"], vocab_size=320, max_seq_len=64, tie_word_embeddings=True)
    with torch.device("meta"):
        model = family.model_cls(args)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.tok_embeddings.weight.shape == (320, 4096)
    assert model.rope_cache.shape == (64, 128)
    assert family.flops_per_token(args, 64) > 6 * count_params(model, exclude_embedding=True)


def test_unknown_family_lists_valid_names():
    with pytest.raises(ValueError, match="llama3"):
        get_family("llama4")
