"""torchtitan v0.2.2's TOML files load unedited: every key of its JobConfig is a dtrain key, renamed, accepted
without effect (named in one warning line) or refused with a reason; model.name is checked first; command-line
flags replace a file's value before it is validated; the migration guide's table is generated from the code."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from dtrain.config import load_config
from dtrain.config.fields import config_fields
from dtrain.config.torchtitan_comparison import TORCHTITAN_V0_2_2_KEYS
from dtrain.config.torchtitan_keys import TORCHTITAN_ONLY
from dtrain.config.torchtitan_table import splice_torchtitan_table
from dtrain.errors import ConfigError

FIXTURES = Path(__file__).parent / "torchtitan_v0_2_2"
REPO = Path(__file__).resolve().parents[2]


def load(path: Path, *flags: str):
    return load_config(["--config", str(path), *flags], env={})


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.toml")), ids=lambda p: p.stem)
def test_torchtitan_files_load_unedited(path):
    cfg = load(path)
    assert cfg.model.name in ("llama3", "qwen3", "deepseek_v3")


def test_keys_without_effect_are_named_in_one_warning_line(caplog):
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        load(FIXTURES / "deepseek_v3_671b.toml", "--fault_tolerance.enable", "false")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "torchtitan keys with no effect in dtrain, accepted: quantize.grouped_mm.float8.fqns "
        "(docs/migrating-from-torchtitan.md)"
    ]


def test_a_file_without_such_keys_warns_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        load(FIXTURES / "llama3_8b.toml")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    "text, message",
    [
        ("[fault_tolerance]\nenable = true\n", "fault_tolerance.group_size must name the number of replica groups"),
        ('[job]\ncustom_config_module = "my.module"\n', "job.custom_config_module = 'my.module' is not supported"),
        ('[training]\ndtype = "bfloat16"\n', "training.dtype = 'bfloat16' is not supported: pure low-precision"),
        ("[parallelism]\npipeline_parallel_first_stage_less_layers = 2\n", "(valid: 1)"),
        ('[model]\nconverters = ["quantize.grouped_mm.float8"]\n',
         "model.converters = quantize.grouped_mm.float8 is not supported: float8 grouped GEMMs"),
    ],
)
def test_values_that_ask_for_what_dtrain_lacks_are_refused(tmp_path, text, message):
    path = tmp_path / "user.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load(path)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_refusal_on_the_command_line_too(tmp_path):
    path = tmp_path / "user.toml"
    path.write_text("")
    with pytest.raises(ConfigError, match=r"^optimizer.early_step_in_backward = true is not supported"):
        load(path, "--optimizer.early_step_in_backward", "true")


def test_model_name_is_checked_before_any_other_key(tmp_path):
    path = tmp_path / "flux.toml"
    path.write_text('[encoder]\nt5_encoder = "t5"\n\n[model]\nname = "flux"\n')
    with pytest.raises(ConfigError, match=r"^model.name must be one of llama3, qwen3, deepseek_v3; got 'flux'"):
        load(path)


def test_command_line_rescues_a_value_not_valid_here(tmp_path):
    path = tmp_path / "user.toml"
    path.write_text('[training]\ndataset = "my_cluster_dataset"\n')
    with pytest.raises(ConfigError, match="training.dataset must be one of"):
        load(path)
    assert load(path, "--training.dataset", "builtin").training.dataset == "builtin"


def test_tokenizer_path_is_renamed(tmp_path):
    path = tmp_path / "user.toml"
    path.write_text('[model]\ntokenizer_path = "./assets/tokenizer"\n')
    assert load(path).model.hf_assets_path == "./assets/tokenizer"


def test_every_torchtitan_key_is_known():
    assert len(TORCHTITAN_V0_2_2_KEYS) == len(set(TORCHTITAN_V0_2_2_KEYS)) == 149
    unknown = [k for k in TORCHTITAN_V0_2_2_KEYS if k not in config_fields() and k not in TORCHTITAN_ONLY]
    assert unknown == []
    assert set(TORCHTITAN_ONLY) <= set(TORCHTITAN_V0_2_2_KEYS)
    # Every key says why it is refused, or why it changes nothing (the migration guide shows it).
    assert all(meaning.reason for meaning in TORCHTITAN_ONLY.values() if meaning.alias is None)


def test_migration_guide_table_is_current():
    doc = (REPO / "docs" / "migrating-from-torchtitan.md").read_text()
    assert splice_torchtitan_table(doc) == doc, "stale: run python scripts/gen_config_docs.py"


def test_save_config_file_must_stay_in_the_run_folder(tmp_path):
    path = tmp_path / "user.toml"
    path.write_text("")
    assert load(path, "--job.save_config_file", "cfg/job.json").job.save_config_file == "cfg/job.json"
    for bad in ("/etc/job.json", "../job.json"):
        with pytest.raises(ConfigError, match="job.save_config_file must be a file name inside job.dump_folder"):
            load(path, "--job.save_config_file", bad)


def test_deterministic_warn_only_needs_deterministic(tmp_path):
    path = tmp_path / "user.toml"
    path.write_text("")
    with pytest.raises(ConfigError, match="debug.deterministic_warn_only only applies with debug.deterministic"):
        load(path, "--debug.deterministic_warn_only")
    assert load(path, "--debug.deterministic", "--debug.deterministic_warn_only").debug.deterministic_warn_only


def test_save_config_file_writes_the_resolved_config_as_json(tmp_path):
    from dtrain.run.train import write_run_files

    cfg = load(FIXTURES / "llama3_8b.toml", "--job.save_config_file", "configs/job_config.json")
    write_run_files(cfg, SimpleNamespace(rank=0), tmp_path)
    saved = json.loads((tmp_path / "configs" / "job_config.json").read_text())
    assert saved["model"]["flavor"] == "8B" and saved["training"]["dataloader"]["num_workers"] == 0
    assert (tmp_path / "config.toml").is_file()
