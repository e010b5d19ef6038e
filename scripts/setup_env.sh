# Sourced by run_train.sh and scripts/test.sh: make sure a Python environment with dtrain installed is active.
#
# An active virtualenv or conda env is used as it is (dtrain is installed into it if missing); otherwise the
# repository's own .venv is created on first use. torch is pinned only when the environment has none, so an
# existing CUDA build (e.g. on a GPU machine) is never replaced. Set DTRAIN_EXTRAS=test to add the test tools.

dtrain_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dtrain_extras="${DTRAIN_EXTRAS:-}"
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES="${TORCHAO_FORCE_SKIP_LOADING_SO_FILES:-1}"

if [ -z "${VIRTUAL_ENV:-}" ] && [ -z "${CONDA_PREFIX:-}" ]; then
    if [ ! -x "$dtrain_root/.venv/bin/python" ]; then
        echo "dtrain: creating $dtrain_root/.venv" >&2
        python3 -m venv "$dtrain_root/.venv"
    fi
    # shellcheck disable=SC1091
    source "$dtrain_root/.venv/bin/activate"
fi

# Reinstall when pyproject.toml/setup.py change or extras are asked for that the environment lacks; the stamp
# (a checksum of both files, then the installed extras) lives inside the environment.
dtrain_stamp="$(python -c 'import sys; print(sys.prefix)')/.dtrain-install-stamp"
dtrain_sum="$(cat "$dtrain_root/pyproject.toml" "$dtrain_root/setup.py" | cksum | cut -d' ' -f1)"
read -r dtrain_have_sum dtrain_have_extras 2>/dev/null < "$dtrain_stamp" || true
if [ "${dtrain_have_sum:-}" != "$dtrain_sum" ] \
    || { [ -n "$dtrain_extras" ] && [ "$dtrain_extras" != "${dtrain_have_extras:-}" ]; } \
    || ! python -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('torch') and u.find_spec('dtrain.models')))" \
        >/dev/null 2>&1; then
    echo "dtrain: installing dependencies into $(python -c 'import sys; print(sys.prefix)')" >&2
    python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    if ! python -c "import torch" >/dev/null 2>&1; then
        python -m pip install -q "torch==2.13.0"
    fi
    python -m pip install -q -e "$dtrain_root${dtrain_extras:+[$dtrain_extras]}"
    echo "$dtrain_sum $dtrain_extras" > "$dtrain_stamp"
fi
unset dtrain_stamp dtrain_sum dtrain_extras dtrain_have_sum dtrain_have_extras
