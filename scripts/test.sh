#!/usr/bin/env bash
# Runs dtrain's test suite, installing what it needs first. Extra arguments go to pytest (e.g. tests/models -k rope).
set -euo pipefail
cd "$(dirname "$0")/.."
DTRAIN_EXTRAS=test source scripts/setup_env.sh
python -c 'import sys, torch; print(f"dtrain tests: torch {torch.__version__}, python {sys.version.split()[0]}")'
exec python -m pytest -q "$@"
