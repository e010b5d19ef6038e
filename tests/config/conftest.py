"""Shared fixtures: a private configs folder, so these tests never depend on the repo's train_configs/."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.config import load_config

DEBUG_TOML = """\
[training]
steps = 40
seq_len = 128
local_batch_size = 4

[compile]
enable = true
"""


@pytest.fixture
def configs_dir(tmp_path: Path) -> Path:
    """A configs folder with debug_model.toml (the default) and an empty other.toml."""
    folder = tmp_path / "train_configs"
    folder.mkdir()
    (folder / "debug_model.toml").write_text(DEBUG_TOML)
    (folder / "other.toml").write_text("")
    return folder


@pytest.fixture
def load(configs_dir: Path):
    """load_config with the private configs folder and an empty environment (unless one is passed)."""

    def _load(argv: list[str], env: dict[str, str] | None = None):
        return load_config(argv, env=env or {}, configs_dir=configs_dir)

    return _load
