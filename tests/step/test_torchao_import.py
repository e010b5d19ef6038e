"""torchao's import-time log lines (skipped C++ extensions, pytree enum deprecations) never reach a dtrain user."""

from __future__ import annotations

import os
import subprocess
import sys

QUIET = "from dtrain.step.torchao_import import quiet_torchao_import\nwith quiet_torchao_import():\n    import torchao.optim"


def _stderr_of(code: str) -> str:
    env = {**os.environ, "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}  # as scripts/setup_env.sh sets it
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_importing_torchao_through_dtrain_prints_nothing():
    assert "Skipping import of cpp extensions" in _stderr_of("import torchao.optim")  # what a bare import says
    assert _stderr_of(QUIET) == ""
