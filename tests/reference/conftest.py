"""The reference suite: dtrain against the reference implementations' own code (torchtitan 0.2.2, transformers),
installed as test-only dependencies, on models built here with random weights."""

from __future__ import annotations

import sys
from pathlib import Path

# run_train.sh in the test's environment (e2e helpers); tiny training states and torchtitan's names (checkpoint).
for folder in ("e2e", "checkpoint"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / folder))
