"""The docs tests run commands through ./run_train.sh as the e2e tests do: their helpers are on the path."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
