"""list[list[str]] fields (the explicit pipeline split): torchtitan's nested TOML lists, strings, CLI, round trip."""

import pytest

from dtrain.config import format_help, load_config, to_toml
from dtrain.errors import ConfigError

SPLIT = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]


def write(configs_dir, text):
    (configs_dir / "split.toml").write_text(text)


def test_nested_toml_lists_as_torchtitan_writes_them(configs_dir, load):
    write(configs_dir, '[parallelism]\nmodule_fqns_per_model_part = [["tok_embeddings", "layers.0"], '
                       '["layers.1", "norm", "output"]]\n')
    assert load(["--config", "split"]).parallelism.module_fqns_per_model_part == SPLIT


def test_space_separated_strings_in_toml_and_on_the_command_line(configs_dir, load):
    write(configs_dir, '[parallelism]\nmodule_fqns_per_model_part = ["tok_embeddings layers.0", "layers.1 norm output"]\n')
    assert load(["--config", "split"]).parallelism.module_fqns_per_model_part == SPLIT
    cli = load(["--parallelism.module_fqns_per_model_part", "tok_embeddings layers.0, layers.1 norm output"])
    assert cli.parallelism.module_fqns_per_model_part == SPLIT
    assert load(["--parallelism.module_fqns_per_model_part", ""]).parallelism.module_fqns_per_model_part == []


def test_wrong_shape_is_one_line_naming_key_and_file(configs_dir, load):
    write(configs_dir, "[parallelism]\nmodule_fqns_per_model_part = [[1, 2]]\n")
    with pytest.raises(ConfigError, match=r"parallelism.module_fqns_per_model_part expects a list of lists of "
                                          r"strings .* \(in .*split.toml\)"):
        load(["--config", "split"])


def test_round_trips_through_the_written_toml_and_shows_in_help(configs_dir, load, tmp_path):
    cfg = load(["--parallelism.module_fqns_per_model_part", "tok_embeddings layers.0,layers.1 norm output"])
    written = tmp_path / "resolved.toml"
    written.write_text(to_toml(cfg))
    assert load_config(["--config", str(written)], env={}).parallelism.module_fqns_per_model_part == SPLIT
    assert "--parallelism.module_fqns_per_model_part LISTS" in format_help()
