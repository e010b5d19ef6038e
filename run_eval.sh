#!/usr/bin/env bash
# Evaluate a checkpoint with EleutherAI's lm-evaluation-harness (the eval extra: DTRAIN_EXTRAS=eval ./scripts/setup_env.sh).
#   ./run_eval.sh --checkpoint outputs/debug_model --tasks dtrain_tiny          (newest committed step)
#   ./run_eval.sh --checkpoint /models/Qwen3-0.6B --hf --tasks hellaswag --limit 100
#   NPROC=2 ./run_eval.sh --checkpoint outputs/debug_model --tasks dtrain_tiny  (each process answers its share)
# Prints the harness's table and `eval/<task>/<metric> value` lines; --help lists every option; config flags
# (--config, --model.*) apply to dtrain checkpoints as in run_generate.sh.
set -euo pipefail
# No cd: paths on the command line are the caller's.
repo_root="$(cd "$(dirname "$0")" && pwd)"
nproc="${NPROC:-1}"
if [[ ! "$nproc" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NPROC=$nproc: use a number of processes (1 or more)" >&2
    exit 2
fi
source "$repo_root/scripts/setup_env.sh"
if [ "$nproc" = "1" ]; then
    exec python -m dtrain.eval "$@"
fi
# One node: torchrun's own rendezvous on a free port of this machine.
exec torchrun --standalone --nproc_per_node "$nproc" --local-ranks-filter 0 -m dtrain.eval "$@"
