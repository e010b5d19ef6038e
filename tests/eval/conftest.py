"""The eval tests' helpers on sys.path (eval_helpers.py here, the gloo worlds of tests/parallelize)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallelize"))
