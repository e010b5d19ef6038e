"""Writing configs out: to_toml round trips, config_to_dict, --help covers every key, the doc matches the schema."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.config import JobConfig, config_fields, config_to_dict, format_help, to_toml
from dtrain.config.reference import splice_reference
from dtrain.config.toml_io import toml_string, tomllib

REPO = Path(__file__).resolve().parents[2]


def _changed_config() -> JobConfig:
    """A config with every kind of value away from its default, including awkward strings."""
    cfg = JobConfig()
    cfg.job.description = 'quote " backslash \\ tab \t newline \n bell \x07 del \x7f unicode é ✓'
    cfg.optimizer.lr = 3e-4
    cfg.optimizer.eps = 1e-12
    cfg.training.steps = 123
    cfg.training.global_batch_size = 64
    cfg.lr_scheduler.decay_ratio = 0.25
    cfg.compile.enable = True
    cfg.compile.components = ["loss"]
    cfg.checkpoint.exclude_from_loading = ["optimizer", "a,b"]
    cfg.model.tie_word_embeddings = False
    cfg.model.args = {"n_layers": 2, "rope_theta": 10000.0, "tie_word_embeddings": True}
    return cfg


def test_round_trip_through_load_config(load, tmp_path: Path):
    cfg = _changed_config()
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg), encoding="utf-8")
    loaded = load(["--config", str(path)])
    assert loaded.job.config_file == str(path.resolve())
    loaded.job.config_file = cfg.job.config_file
    assert loaded == cfg


def test_round_trip_of_a_loaded_config_is_a_fixed_point(load, tmp_path: Path):
    cfg = load(["--training.steps", "9", "--compile.components", ""])
    path = tmp_path / "again.toml"
    path.write_text(to_toml(cfg), encoding="utf-8")
    again = load(["--config", str(path)])
    assert to_toml(again).replace(str(path.resolve()), cfg.job.config_file) == to_toml(cfg)


def test_every_section_and_set_key_is_written_none_omitted():
    data = tomllib.loads(to_toml(JobConfig()))
    plain = config_to_dict(JobConfig())
    assert list(data) == list(plain)
    def set_values(values: dict) -> dict:
        # Unset keys and empty tables (nothing to override) are left out, in nested sections too.
        return {k: set_values(v) if isinstance(v, dict) else v for k, v in values.items() if v is not None and v != {}}

    for section, values in plain.items():
        assert data[section] == set_values(values)
    assert "decay_ratio" not in data["lr_scheduler"]
    assert "prefetch_factor" not in data["training"]["dataloader"]


def test_config_to_dict_has_fresh_lists_and_keeps_none():
    cfg = JobConfig()
    plain = config_to_dict(cfg)
    plain["compile"]["components"].append("x")
    assert cfg.compile.components == ["model", "loss"]
    assert plain["lr_scheduler"]["decay_ratio"] is None
    assert plain["training"]["steps"] == cfg.training.steps


@pytest.mark.parametrize("text", ["", "plain", 'a"b', "a\\b", "\x00\x1f\x7f", "line1\r\nline2", "日本"])
def test_toml_string_escaping(text):
    assert tomllib.loads(f"v = {toml_string(text)}")["v"] == text


def test_help_lists_every_field_with_type_default_doc():
    text = format_help()
    for spec in config_fields().values():
        assert f"--{spec.key}" in text, spec.key
        assert spec.doc.split()[0] in text
    for section in config_fields().values():
        assert f"[{section.section}]" in text
    assert "--lr_scheduler.decay_type {linear,sqrt,cosine}  (default: linear)" in text
    assert "--training.steps INT  (default: 10000; >= 1)" in text
    assert "--compile.enable | --compile.no_enable  (default: false)" in text
    assert "--compile.components LIST  (default: model,loss)" in text
    assert "--lr_scheduler.decay_ratio FLOAT|none  (default: none; >= 0)" in text
    for header_part in ("--config NAME|PATH", "each overrides the one before", "--section.key=VALUE", "no_enable"):
        assert header_part in text


def test_help_shows_resolved_values_when_given_a_config(load):
    text = format_help(load(["--training.steps", "77"]))
    assert "--training.steps INT  (default: 77; >= 1)" in text
    assert "--training.seq_len INT  (default: 128; >= 2)" in text  # from the TOML file


def test_docs_field_reference_is_up_to_date():
    doc = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert splice_reference(doc) == doc, "docs/configuration.md is stale: run python scripts/gen_config_docs.py"
    for spec in config_fields().values():
        assert f"`[{spec.section}]`" in doc


def test_docs_check_script_exit_code():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_config_docs.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
