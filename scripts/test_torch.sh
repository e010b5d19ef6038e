#!/usr/bin/env bash
# Runs dtrain's test suite under a given torch release, in an environment of its own (.venv-torchVERSION,
# created and installed on first use). CI runs it with 2.11.0, the version on the GPU machines, after the main
# suite. Extra arguments go to pytest.
#   ./scripts/test_torch.sh 2.11.0
#   ./scripts/test_torch.sh 2.11.0 tests/parallelize -k pipeline
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "usage: scripts/test_torch.sh TORCH_VERSION [pytest arguments], e.g. scripts/test_torch.sh 2.11.0" >&2
    exit 2
fi
version="$1"
shift
DTRAIN_TORCH_VERSION="$version" exec ./scripts/test.sh "$@"
