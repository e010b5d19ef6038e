"""`./scripts/test.sh --quick` names tests that exist and covers every layer: a renamed file or test must not
silently shrink the smoke subset a new user runs to check an install."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def quick_subset() -> list[str]:
    script = (REPO / "scripts" / "test.sh").read_text()
    block = re.search(r"^QUICK=\((.*?)^\)", script, re.S | re.M)
    assert block, "scripts/test.sh has no QUICK=( ... ) list"
    return block.group(1).split()


def test_every_quick_test_is_collected_and_every_layer_is_covered():
    subset = quick_subset()
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *subset],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    ids = [line for line in collected.stdout.splitlines() if "::" in line]
    for entry in subset:  # each file or test of the list exists and contributes tests
        assert any(i == entry or i.startswith(entry + "::") or i.startswith(entry + "[") for i in ids), entry
    for layer in ("tests/config/", "tests/models/", "tests/step/", "tests/data/", "tests/parallelize/test_parity",
                  "tests/checkpoint/", "tests/e2e/"):
        assert any(i.startswith(layer) for i in ids), layer
