"""`[model.args]` / `--model.args.<field>`: shape overrides, typed and checked against the family's args class."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dtrain.config import format_help, to_toml
from dtrain.errors import ConfigError
from dtrain.parallelize import get_family
from dtrain.run.prepare import prepare


def test_toml_table_and_flags_merge_flags_last(load, configs_dir: Path):
    (configs_dir / "small.toml").write_text("[model.args]\nn_layers = 3\ndim = 512\n")
    cfg = load(["--config", "small", "--model.args.dim", "128", "--model.args.norm_eps=1e-6"])
    assert cfg.model.args == {"n_layers": 3, "dim": "128", "norm_eps": "1e-6"}  # flags stay text until typed
    args = prepare(cfg).model_args
    assert (args.n_layers, args.dim, args.norm_eps) == (3, 128, 1e-6)
    assert args.n_heads == 16 and args.vocab_size == 2048  # the rest, the vocabulary too: the flavor's (torchtitan)


def test_the_vocabulary_is_the_flavors_unless_sized_from_the_tokenizer(load, monkeypatch):
    assert prepare(load([])).model_args.vocab_size == 2048
    sized = prepare(load(["--model.vocab_size_from_tokenizer", "--model.vocab_size_multiple_of", "128"]))
    assert sized.model_args.vocab_size == 384  # the byte tokenizer's 258 ids, rounded up
    flavors = get_family("llama3").model.flavors
    monkeypatch.setitem(flavors, "debugmodel", replace(flavors["debugmodel"], vocab_size=200))
    with pytest.raises(ConfigError, match=r"^model.flavor 'debugmodel' has vocab_size 200, smaller than the token"):
        prepare(load([]))


def test_the_resolved_shape_is_what_config_toml_records_and_rebuilds(load, tmp_path: Path):
    cfg = load(["--model.args.n_layers", "2", "--model.args.ffn_dim_multiplier", "none"])
    args = prepare(cfg).model_args
    assert cfg.model.args["n_layers"] == 2 and cfg.model.args["dim"] == 256 and cfg.model.args["vocab_size"] == 2048
    written = tmp_path / "config.toml"
    written.write_text(to_toml(cfg))
    assert "[model.args]\ndim = 256\nn_layers = 2\n" in written.read_text()
    assert prepare(load(["--config", str(written)])).model_args == args


def test_another_family_checks_its_own_fields(load):
    args = prepare(load(["--model.name", "qwen3", "--model.args.head_dim", "64", "--model.args.n_layers", "2"]))
    assert (args.model_args.head_dim, args.model_args.n_layers, args.model_args.dim) == (64, 2, 256)
    with pytest.raises(ConfigError, match=r"unknown key model.args.multiple_of \(qwen3 has dim, n_layers"):
        prepare(load(["--model.name", "qwen3", "--model.args.multiple_of", "8"]))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model.args.n_layerz", "2"], "unknown key model.args.n_layerz (did you mean model.args.n_layers?)"),
        (["--model.args.n_layers", "two"], "model.args.n_layers expects an integer, got 'two'"),
        (["--model.args.n_layers", "+-2"], "model.args.n_layers expects an integer, got '+-2'"),
        (["--model.args.n_layers", "0"], "model.args: Llama3Args.n_layers must be > 0, got 0"),
        (["--model.args.dim", "100"], "model.args: Llama3Args.dim (100) must be divisible by n_heads (16)"),
        (["--model.args.rope_theta", "fast"], "model.args.rope_theta expects a number, got 'fast'"),
        (["--model.args.tie_word_embeddings", "maybe"], "model.args.tie_word_embeddings expects a boolean"),
        (["--model.args.rope_scaling", "x"], "model.args.rope_scaling expects a table of factor, low_freq_factor, "
                                             "high_freq_factor, original_max_position_embeddings (TOML "
                                             "[model.args.rope_scaling]) or none, got 'x'"),
        (["--model.args.vocab_size", "100"], "model.args.vocab_size=100 is smaller than the tokenizer's 258 tokens"),
    ],
)
def test_bad_overrides_are_one_line_errors_naming_the_field(load, argv, message):
    with pytest.raises(ConfigError) as error:
        prepare(load(argv))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_table_entry_needs_a_value_and_help_shows_the_form(load):
    with pytest.raises(ConfigError, match="--model.args.n_layers expects a value"):
        load(["--model.args.n_layers"])
    assert "--model.args.NAME VALUE" in format_help()
