"""Regenerate the field reference in docs/configuration.md from the config schema, and the torchtitan key table in
docs/migrating-from-torchtitan.md from dtrain/config/torchtitan_keys.py and torchtitan_comparison.py.

Usage: python scripts/gen_config_docs.py [--check]
With --check, write nothing and exit 1 when a committed doc is out of date (tests/config runs the same check).
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import sys
from pathlib import Path

from dtrain.config.reference import splice_reference
from dtrain.config.torchtitan_table import splice_torchtitan_table

DOCS = Path(__file__).resolve().parents[1] / "docs"
GENERATED = {DOCS / "configuration.md": splice_reference, DOCS / "migrating-from-torchtitan.md": splice_torchtitan_table}


def main(argv: list[str]) -> int:
    stale = 0
    for doc, splice in GENERATED.items():
        current = doc.read_text(encoding="utf-8")
        updated = splice(current)
        if "--check" in argv:
            if updated != current:
                print(f"{doc} is out of date; run: python scripts/gen_config_docs.py", file=sys.stderr)
                stale = 1
            continue
        doc.write_text(updated, encoding="utf-8")
        print(f"wrote {doc}")
    return stale


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
