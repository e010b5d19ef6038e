"""Runs a script of this folder that calls torchtitan's own code in a subprocess of the test's interpreter (its
package cannot be imported in the pytest process: triton_stub.py), and fails the test with the end of its stderr
when the script fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def run_reference_script(name: str, *args: str | Path, cwd: Path = REPO) -> None:
    result = subprocess.run(
        [sys.executable, str(HERE / name), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
