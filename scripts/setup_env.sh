#!/usr/bin/env bash
# Sourced by run_train.sh and scripts/test.sh: make sure a Python environment with dtrain installed is active.
# Run directly (./scripts/setup_env.sh), it only builds that environment and says which it is: once on a cluster's
# login node, before submitting jobs whose nodes share the checkout (docs/cluster.md).
#
# An active virtualenv or conda env is used as it is (dtrain is installed into it if missing); otherwise the
# repository's own .venv is created on first use. torch is pinned only when the environment has none, so an
# existing CUDA build (e.g. on a GPU machine) is never replaced. Set DTRAIN_EXTRAS=test to add the test tools.
#
# DTRAIN_TORCH_VERSION=X.Y.Z asks for that torch release instead, in an environment of its own
# (.venv-torchX.Y.Z in the repository, whatever environment is active), made on first use; scripts/test_torch.sh
# runs the suite that way. From the package index, torch releases other than the local CPU build come as CUDA
# builds with their CUDA runtime packages (several GB), which run on a CPU too.
#
# DTRAIN_NO_INSTALL=1 (set by scripts/slurm/train.sbatch and launch_node.sh) never creates or installs: a missing
# or out-of-date environment is one line saying what to run once instead. Compute nodes often have no internet, and
# every node installing into the shared checkout at once would race.

if [ "${BASH_SOURCE[0]}" = "$0" ]; then set -euo pipefail; fi  # run, not sourced: stop at the first failure
dtrain_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dtrain_extras="${DTRAIN_EXTRAS:-}"
dtrain_torch="${DTRAIN_TORCH_VERSION:-}"
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES="${TORCHAO_FORCE_SKIP_LOADING_SO_FILES:-1}"

if [ -n "$dtrain_torch" ]; then
    dtrain_venv="$dtrain_root/.venv-torch$dtrain_torch"
elif [ -z "${VIRTUAL_ENV:-}" ] && [ -z "${CONDA_PREFIX:-}" ]; then
    dtrain_venv="$dtrain_root/.venv"
else
    dtrain_venv=""
fi
# What to say instead of building, when DTRAIN_NO_INSTALL forbids it; `return` ends a sourced run, `exit` a run.
dtrain_refuse() {
    echo "error: $*, and DTRAIN_NO_INSTALL=$DTRAIN_NO_INSTALL forbids building it here (a compute node): run" \
        "$dtrain_root/scripts/setup_env.sh once on the login node, then start the job again" >&2
}
if [ -n "$dtrain_venv" ]; then
    if [ ! -x "$dtrain_venv/bin/python" ] && [ "${DTRAIN_NO_INSTALL:-0}" != 0 ]; then
        dtrain_refuse "no Python environment at $dtrain_venv"
        return 2 2>/dev/null || exit 2
    fi
    if [ ! -x "$dtrain_venv/bin/python" ]; then
        echo "dtrain: creating $dtrain_venv" >&2
        python3 -m venv "$dtrain_venv"
    fi
    # shellcheck disable=SC1091
    source "$dtrain_venv/bin/activate"
fi

# Reinstall when pyproject.toml/setup.py change, extras are asked for that the environment lacks, or the torch
# asked for is not the one installed; the stamp (a checksum of both files, then the installed extras) lives
# inside the environment.
dtrain_prefix="$(python -c 'import sys; print(sys.prefix)')"
dtrain_stamp="$dtrain_prefix/.dtrain-install-stamp"
dtrain_sum="$(cat "$dtrain_root/pyproject.toml" "$dtrain_root/setup.py" | cksum | cut -d' ' -f1)"
dtrain_have_torch="$(python -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])' 2>/dev/null || true)"
read -r dtrain_have_sum dtrain_have_extras 2>/dev/null < "$dtrain_stamp" || true
if [ "${dtrain_have_sum:-}" != "$dtrain_sum" ] \
    || { [ -n "$dtrain_extras" ] && [ "$dtrain_extras" != "${dtrain_have_extras:-}" ]; } \
    || { [ -n "$dtrain_torch" ] && [ "$dtrain_torch" != "$dtrain_have_torch" ]; } \
    || ! python -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('torch') and u.find_spec('dtrain.models')))" \
        >/dev/null 2>&1; then
    if [ "${DTRAIN_NO_INSTALL:-0}" != 0 ]; then
        dtrain_refuse "the Python environment $dtrain_prefix is not ready for this checkout (torch or dtrain" \
            "missing, or pyproject.toml/setup.py changed since it was installed)"
        return 2 2>/dev/null || exit 2
    fi
    echo "dtrain: installing dependencies into $dtrain_prefix" >&2
    python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    if [ -n "$dtrain_torch" ] && [ "$dtrain_torch" != "$dtrain_have_torch" ]; then
        python -m pip install -q "torch==$dtrain_torch"
    elif [ -z "$dtrain_have_torch" ]; then
        python -m pip install -q "torch==2.13.0"
    fi
    # setuptools announces every editable install with a boxed warning that asks nothing of the user.
    PYTHONWARNINGS=ignore python -m pip install -q -e "$dtrain_root${dtrain_extras:+[$dtrain_extras]}"
    echo "$dtrain_sum $dtrain_extras" > "$dtrain_stamp"
fi
if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run, not sourced: say what was built
    echo "dtrain: Python environment ready: $dtrain_prefix" >&2
fi
unset -f dtrain_refuse
unset dtrain_prefix dtrain_stamp dtrain_sum dtrain_extras dtrain_have_sum dtrain_have_extras dtrain_torch dtrain_have_torch dtrain_venv
