"""Imported first by every script here: started by an interpreter that lacks dtrain (a fresh shell's `python`),
the script runs again under the repository's own environment, the one run_train.sh creates and uses (.venv), so
that `python scripts/<name>.py` works without activating anything. An interpreter that has dtrain is kept as is
(an activated or conda environment, the test suite's)."""

import importlib.util
import os
import sys
from pathlib import Path

if importlib.util.find_spec("torch") is None or importlib.util.find_spec("dtrain") is None:
    # Not resolved: a checkout reached through a link keeps its own .venv.
    python = Path(sys.argv[0]).absolute().parent.parent / ".venv" / "bin" / "python"
    if not python.exists():
        sys.exit(f"error: {sys.executable} has no torch or dtrain, and {python} does not exist: run "
                 "./scripts/setup_env.sh once (or ./run_train.sh), or activate the environment dtrain is installed in")
    if Path(sys.executable).absolute() == python:
        sys.exit(f"error: {python} has no torch or dtrain: run ./scripts/setup_env.sh to install them")
    os.execv(str(python), [str(python), *sys.argv])
