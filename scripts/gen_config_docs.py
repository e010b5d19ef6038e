"""Regenerate the field reference in docs/configuration.md from the config schema.

Usage: python scripts/gen_config_docs.py [--check]
With --check, write nothing and exit 1 when the committed doc is out of date (tests/config runs the same check).
"""

from __future__ import annotations

import sys
from pathlib import Path

from dtrain.config.reference import splice_reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def main(argv: list[str]) -> int:
    current = DOC.read_text(encoding="utf-8")
    updated = splice_reference(current)
    if "--check" in argv:
        if updated != current:
            print(f"{DOC} is out of date; run: python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(updated, encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
