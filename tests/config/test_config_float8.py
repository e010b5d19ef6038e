"""[model] converters and the nested [quantize.linear.float8] section: loading, writing back, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.config import JobConfig, format_help, to_toml, validate_config
from dtrain.config.converters import check_mx_compute_dtype
from dtrain.config.loader import apply_toml
from dtrain.config.schema_opt_in import QuantizeLinearMX
from dtrain.config.toml_io import read_toml
from dtrain.errors import ConfigError
from dtrain.run.prepare import check_converters_on_this_torch

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
        ("[quantize.linear.mx]\nrecipe_name = 'mxfp8_cublas'\n", [], "quantize.linear.mx.recipe_name"),
        ("", ["--model.converters", "fp8"],
         "model.converters may contain float8 or mx (or quantize.linear.float8, quantize.linear.mx); got 'fp8'"),
        ("", ["--model.converters", "float8,mx"], "model.converters: float8 and mx both convert the linears"),
        ("", ["--quantize.linear.float8.recipe_name", "rowwise", "--quantize.linear.float8.enable_fsdp_float8_all_gather"],
         "quantize.linear.float8.enable_fsdp_float8_all_gather needs quantize.linear.float8.recipe_name = tensorwise"),
        ("", ["--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"],
         "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp needs "
         "quantize.linear.float8.enable_fsdp_float8_all_gather = true"),
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


def mx_config(**mx) -> JobConfig:
    cfg = JobConfig()
    cfg.model.converters = ["quantize.linear.mx"]
    cfg.quantize.linear.mx = QuantizeLinearMX(**mx)
    return cfg


def test_mx_matmul_recipes_refused_without_blackwell_naming_this_machine(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda *a: (9, 0))
    with pytest.raises(ConfigError, match=r"recipe_name = mxfp8_rceil needs a Blackwell-class GPU \(CUDA compute "
                                          r"capability >= 10\.0\); this machine has a GPU of compute capability 9\.0 "
                                          r"\(recipe_name = mxfp8_emulated_rceil emulates"):
        validate_config(mx_config())
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda *a: (10, 0))
    validate_config(mx_config())
    validate_config(mx_config(recipe_name="mxfp8_emulated_rceil"))  # anywhere


def test_mx_needs_the_torch_torchao_supports(monkeypatch):
    monkeypatch.setattr("dtrain.run.prepare.MXFP8_TRAINING_SUPPORTED", False)
    with pytest.raises(ConfigError, match=r"torchao's MXFP8 training needs torch 2\.13"):
        cfg = mx_config(recipe_name="mxfp8_emulated_rceil")
        check_converters_on_this_torch(cfg.model.converters, cfg.parallelism)


def test_mx_refuses_tensor_parallel():
    cfg = mx_config(recipe_name="mxfp8_emulated_rceil")
    cfg.parallelism.tensor_parallel_degree = 2
    with pytest.raises(ConfigError, match="model.converters = mx does not compose with tensor parallel"):
        validate_config(cfg)


def test_emulated_mx_without_fsdp_computes_in_fp32():
    cfg = mx_config(recipe_name="mxfp8_emulated_rceil")
    check_mx_compute_dtype(cfg, fsdp_enabled=True)
    with pytest.raises(ConfigError, match="needs training.mixed_precision_param = float32 \\(got bfloat16\\)"):
        check_mx_compute_dtype(cfg, fsdp_enabled=False)
    check_mx_compute_dtype(mx_config(), fsdp_enabled=False)  # MX matmuls: bf16 operands are theirs to cast
    cfg.training.mixed_precision_param = "float32"
    check_mx_compute_dtype(cfg, fsdp_enabled=False)


def test_float8_with_a_split_backward_schedule_needs_newer_torch(monkeypatch):
    monkeypatch.setattr("dtrain.run.prepare.SPLIT_BACKWARD_RUNS_CUSTOM_FUNCTIONS", False)
    cfg = JobConfig()
    cfg.model.converters = ["float8"]
    cfg.parallelism.pipeline_parallel_degree = 2
    cfg.parallelism.pipeline_parallel_schedule = "ZBVZeroBubble"
    with pytest.raises(ConfigError, match=r"pipeline_parallel_schedule = ZBVZeroBubble needs torch 2\.13 .*use 1F1B"):
        check_converters_on_this_torch(cfg.model.converters, cfg.parallelism)
    cfg.parallelism.pipeline_parallel_schedule = "1F1B"
    check_converters_on_this_torch(cfg.model.converters, cfg.parallelism)
