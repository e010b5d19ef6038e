"""Which TOML file a run reads, and the precedence defaults < TOML < command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.config import JobConfig, load_config
from dtrain.config.loader import default_configs_dir
from dtrain.errors import ConfigError
from dtrain.parallelize import get_family


def test_no_config_reads_debug_model(load, configs_dir: Path):
    cfg = load([])
    assert cfg.job.config_file == str((configs_dir / "debug_model.toml").resolve())
    assert cfg.training.steps == 40


@pytest.mark.parametrize("argv", [["--config", "other"], ["--config", "other.toml"], ["--config=other"]])
def test_bare_name_with_or_without_suffix(load, configs_dir: Path, argv):
    cfg = load(argv)
    assert cfg.job.config_file == str((configs_dir / "other.toml").resolve())
    assert cfg.training.steps == JobConfig().training.steps  # other.toml is empty: defaults


def test_existing_path_is_used_as_is(load, tmp_path: Path):
    path = tmp_path / "elsewhere" / "mine.toml"
    path.parent.mkdir()
    path.write_text("[training]\nsteps = 7\n")
    for argv in (["--config", str(path)], ["--job.config_file", str(path)], ["--job.config-file=" + str(path)]):
        cfg = load(argv)
        assert cfg.training.steps == 7
        assert cfg.job.config_file == str(path.resolve())


def test_config_file_env_and_flag_precedence(load, configs_dir: Path):
    assert load([], env={"CONFIG_FILE": "other"}).training.steps == JobConfig().training.steps
    # A --config flag wins over the environment.
    assert load(["--config", "debug_model"], env={"CONFIG_FILE": "other"}).training.steps == 40


def test_configs_dir_from_env(configs_dir: Path):
    assert default_configs_dir({"DTRAIN_CONFIGS_DIR": str(configs_dir)}) == configs_dir
    cfg = load_config(["--config", "other"], env={"DTRAIN_CONFIGS_DIR": str(configs_dir)})
    assert cfg.job.config_file == str((configs_dir / "other.toml").resolve())


def test_default_configs_dir_is_repo_train_configs():
    repo_root = Path(__file__).resolve().parents[2]
    assert default_configs_dir({}) == repo_root / "train_configs"


def test_missing_file_names_it_and_lists_available(load):
    with pytest.raises(ConfigError) as err:
        load(["--config", "llama3_9b"])
    message = str(err.value)
    assert "'llama3_9b'" in message and "debug_model, other" in message
    assert "\n" not in message


def test_missing_path_and_missing_default(load, configs_dir: Path, tmp_path: Path):
    with pytest.raises(ConfigError, match="nope/x.toml"):
        load(["--config", "nope/x.toml"])
    (configs_dir / "debug_model.toml").unlink()
    with pytest.raises(ConfigError, match=r"'debug_model' not found .*available: other"):
        load([])


def test_directory_and_empty_name_are_errors(load, tmp_path: Path):
    with pytest.raises(ConfigError, match="is a directory"):
        load(["--config", str(tmp_path)])
    with pytest.raises(ConfigError, match="empty config name"):
        load(["--config="])
    with pytest.raises(ConfigError, match="--config expects a value"):
        load(["--config"])


def test_precedence_default_toml_cli(load):
    defaults = JobConfig()
    cfg = load(["--training.seq_len", "64"])
    assert cfg.optimizer.lr == defaults.optimizer.lr  # only the default says anything
    assert cfg.training.steps == 40  # TOML over default
    assert cfg.training.seq_len == 64  # CLI over TOML
    assert cfg.compile.enable is True
    assert load(["--compile.no_enable"]).compile.enable is False  # CLI switches off what TOML switched on


def test_repeated_flag_last_wins(load):
    assert load(["--training.steps", "3", "--training.steps=5"]).training.steps == 5


def test_toml_value_types(load, configs_dir: Path):
    (configs_dir / "typed.toml").write_text(
        '[optimizer]\nlr = 1\n[checkpoint]\nexclude_from_loading = ["optimizer"]\n'
        "[lr_scheduler]\ndecay_ratio = 0.25\n[model]\ntie_word_embeddings = true\n"
    )
    cfg = load(["--config", "typed"])
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.checkpoint.exclude_from_loading == ["optimizer"]
    assert cfg.lr_scheduler.decay_ratio == 0.25
    assert cfg.model.tie_word_embeddings is True
    # Optional keys can be unset from the command line again.
    assert load(["--config", "typed", "--lr_scheduler.decay_ratio", "none"]).lr_scheduler.decay_ratio is None


def test_lists_are_not_shared_with_defaults(load):
    cfg = load([])
    cfg.compile.components.append("extra")
    assert load([]).compile.components == ["model", "loss"]


def test_every_shipped_config_loads_and_names_a_registered_family_and_flavor():
    repo_configs = Path(__file__).resolve().parents[2] / "train_configs"
    files = sorted(repo_configs.glob("*.toml"))
    assert {"debug_model.toml", "llama3_8b.toml", "qwen3_0.6b.toml"} <= {f.name for f in files}
    for file in files:
        cfg = load_config(["--config", str(file)])
        assert cfg.model.flavor in get_family(cfg.model.name).model.flavors, file.name
