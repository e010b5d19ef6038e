"""Fixtures of the checkpoint tests, and the helper folders of other test directories on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# run_train.sh in the test's environment (e2e) and spawned gloo worlds (parallelize).
for folder in ("e2e", "parallelize"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / folder))


def pytest_configure(config):
    # DCP warns on every save and load without a process group that it assumes one process; dtrain filters that
    # warning, but pytest resets the filters for each test.
    config.addinivalue_line("filterwarnings", "ignore:torch.distributed is .*single process:UserWarning")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
