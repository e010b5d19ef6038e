"""[model] converters and the nested [quantize.linear.float8] section: loading, writing back, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.config import JobConfig, format_help, to_toml, validate_config
from dtrain.config.loader import apply_toml
from dtrain.config.toml_io import read_toml
from dtrain.errors import ConfigError

FLOAT8_TOML = """\
[model]
converters = ["float8"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = true
precompute_float8_dynamic_scale_for_fsdp = true
filter_fqns = ["output", "attention.wq"]
"""


def test_nested_section_loads_from_toml_and_writes_back(load, configs_dir: Path, tmp_path: Path):
    (configs_dir / "f8.toml").write_text(FLOAT8_TOML)
    cfg = load(["--config", "f8"])
    f8 = cfg.quantize.linear.float8
    assert cfg.model.converters == ["float8"]
    assert (f8.enable_fsdp_float8_all_gather, f8.precompute_float8_dynamic_scale_for_fsdp) == (True, True)
    assert f8.filter_fqns == ["output", "attention.wq"] and f8.recipe_name == "tensorwise"
    written = tmp_path / "resolved.toml"
    written.write_text(to_toml(cfg))
    assert "[quantize.linear.float8]" in written.read_text()
    again = JobConfig()
    apply_toml(again, read_toml(written), str(written))
    assert again == cfg


def test_nested_keys_on_the_command_line_and_in_help(load):
    cfg = load([
        "--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "rowwise",
        "--quantize.linear.float8.filter_fqns", "output,w2", "--quantize.linear.float8.emulate",
    ])
    f8 = cfg.quantize.linear.float8
    assert (f8.recipe_name, f8.filter_fqns, f8.emulate) == ("rowwise", ["output", "w2"], True)
    assert load(["--quantize.linear.float8.no_emulate"]).quantize.linear.float8.emulate is False
    assert "--quantize.linear.float8.recipe_name {tensorwise,rowwise,rowwise_with_gw_hp}" in format_help()


@pytest.mark.parametrize(
    "toml, argv, message",
    [
        ("[quantize.linear.float8]\nrecipe = 'rowwise'\n", [],
         "unknown key quantize.linear.float8.recipe in {path} (did you mean quantize.linear.float8.recipe_name?)"),
        ("[quantize.linear.flaot8]\nemulate = true\n", [],
         "unknown key quantize.linear.flaot8.emulate in {path} (did you mean quantize.linear.float8.emulate?)"),
        ("", ["--quantize.linear.float8.recipe_name", "delayed"], "quantize.linear.float8.recipe_name"),
        ("[quantize.linear.mx]\nrecipe_name = 'mxfp8_cublas'\n", [],
         "[quantize.linear.mx] in {path}: MX (mxfp8) training needs a Blackwell-class GPU"),
        ("", ["--model.converters", "mx"], "model.converters = mx: MX (mxfp8) training needs a Blackwell-class GPU"),
        ("", ["--model.converters", "fp8"], "model.converters may contain float8 (or quantize.linear.float8); got 'fp8'"),
        ("", ["--quantize.linear.float8.recipe_name", "rowwise", "--quantize.linear.float8.enable_fsdp_float8_all_gather"],
         "quantize.linear.float8.enable_fsdp_float8_all_gather needs quantize.linear.float8.recipe_name = tensorwise"),
        ("", ["--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"],
         "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp needs "
         "quantize.linear.float8.enable_fsdp_float8_all_gather = true"),
        ("", ["--model.converters", "float8", "--parallelism.tensor_parallel_degree", "2"],
         "model.converters = float8 does not compose with tensor parallel yet"),
    ],
)
def test_errors_are_one_line_and_name_the_key(load, configs_dir: Path, toml: str, argv: list[str], message: str):
    path = configs_dir / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as err:
        load(["--config", "bad", *argv])
    text = str(err.value)
    assert "\n" not in text
    assert message.format(path=path) in text


def test_mx_refusal_names_this_machine(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda *a: (9, 0))
    cfg = JobConfig()
    cfg.model.converters = ["quantize.linear.mx"]
    with pytest.raises(ConfigError, match=r"compute capability >= 10\.0\); this machine has a GPU of compute capability 9\.0"):
        validate_config(cfg)
