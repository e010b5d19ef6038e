#!/usr/bin/env bash
# Train with dtrain.
#   ./run_train.sh                                   the debug model on the built-in corpus (CPU or GPU)
#   ./run_train.sh --config llama3_8b --training.steps 10
#   NPROC=4 ./run_train.sh --parallelism.tensor_parallel_degree 2
#
# Environment:
#   NPROC (alias NGPU)   processes on this machine; default: the number of GPUs, or 1 on CPU (both set: equal)
#   NNODES, NODE_RANK    multi-node runs; with RDZV_ENDPOINT (host:port, c10d rendezvous, preferred)
#                        or MASTER_ADDR/MASTER_PORT (static rendezvous)
#   LOG_RANK             which local rank prints (default 0; "all" for every rank)
#   MAX_RESTARTS         restart the workers up to this many times after a failure (torchrun --max-restarts);
#                        restarted workers resume from the last checkpoint (default 0)
#   CONFIG_FILE          config file or name, as --config (torchtitan habit)
set -euo pipefail
# No cd: paths on the command line and relative paths inside a config file (job.dump_folder, model.hf_assets_path,
# torchtitan's "./tests/assets/tokenizer") are the caller's, as with torchtitan; a bare --config name is looked up in
# train_configs/ wherever the caller stands.
repo_root="$(cd "$(dirname "$0")" && pwd)"

nproc="${NPROC:-${NGPU:-}}"
nnodes="${NNODES:-1}"
log_rank="${LOG_RANK:-0}"
# Every launch variable is checked before anything starts or is written (even the Python environment): one line
# naming it, exit code 2 (see rendezvous.sh).
source "$repo_root/scripts/rendezvous.sh" --check
# NGPU is NPROC's other name (torchtitan's): two values would leave one of them silently ignored.
if [ -n "${NPROC:-}" ] && [ -n "${NGPU:-}" ] && [ "$NPROC" != "$NGPU" ]; then
    launch_env_error NGPU "$NGPU" "it disagrees with NPROC=$NPROC (NGPU is another name for NPROC); set one of them"
fi
if [ -n "$nproc" ] && [[ ! "$nproc" =~ ^[1-9][0-9]*$ ]]; then
    nproc_name="$([ -n "${NPROC:-}" ] && echo NPROC || echo NGPU)"
    launch_env_error "$nproc_name" "$nproc" "use a number of processes (1 or more)"
fi
[[ "${MAX_RESTARTS:-0}" =~ ^(0|[1-9][0-9]*)$ ]] ||
    launch_env_error MAX_RESTARTS "$MAX_RESTARTS" "use a number of restarts (0 or more)"
if [ "$log_rank" != "all" ] &&
    { [[ ! "$log_rank" =~ ^(0|[1-9][0-9]*)$ ]] || { [ -n "$nproc" ] && [ "$log_rank" -ge "$nproc" ]; }; }; then
    launch_env_error LOG_RANK "$log_rank" "use a local rank (0 to NPROC - 1) or 'all'"
fi

source "$repo_root/scripts/setup_env.sh"
if [ -z "$nproc" ]; then
    # One process per GPU torch can use. Without a GPU device node (NVIDIA's, or ROCm's /dev/kfd) there is none:
    # one process, without importing torch for a second only to learn that (every CPU run, and each test's).
    if compgen -G "/dev/nvidia[0-9]*" >/dev/null || [ -e /dev/kfd ]; then
        nproc="$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')"
    else
        nproc=1
    fi
fi

if [ "$nproc" = "1" ] && [ "$nnodes" = "1" ]; then
    exec python -m dtrain.main "$@"
fi

rank_filter=()
if [ "$log_rank" != "all" ]; then
    rank_filter=(--local-ranks-filter "$log_rank")
fi
# torch shares the agents' rendezvous store with the workers by default, and a restarted worker can then read
# its peers' addresses from the failed attempt (pytorch/pytorch#135712): give each attempt a store of its own.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
launch_dir="$(mktemp -d)"  # private (0700): the single-node stores below, the workers' error lines
source "$repo_root/scripts/rendezvous.sh" "$launch_dir" dtrain
# Validate once, before torchrun starts any worker: a bad config gets one line, not one per rank plus
# torchrun's failure report. --help and print_config are answered here too.
# Exit code 3 means the check answered the request itself (--help, print_config): nothing to launch.
check=0
WORLD_SIZE=$((nproc * nnodes)) DTRAIN_RUN_DIR_FILE="$launch_dir/run_dir" DTRAIN_LAUNCH_SHELL_PID=$$ \
    python -m dtrain.main --launcher_check "$@" || check=$?
if [ "$check" != 0 ]; then rm -rf "$launch_dir"; fi
if [ "$check" = 3 ]; then exit 0; fi
if [ "$check" != 0 ]; then exit "$check"; fi

export LOG_RANK="$log_rank"
# A launcher killed by SIGKILL cannot remove its launch folder: the workers do once it is gone (parent_watch.py).
# exec keeps this shell's pid, so $$ is the launcher's.
export DTRAIN_LAUNCH_DIR="$launch_dir" DTRAIN_LAUNCHER_PID="$$"
# torchrun runs under dtrain/reliability/launcher.py: the run ends with the first failing rank's one line, torchrun's own
# report goes to a file in the run folder, and signals reach torchrun once.
exec python -m dtrain.reliability.launcher "$launch_dir" torchrun --nproc_per_node "$nproc" "${rendezvous[@]}" \
    --max-restarts "${MAX_RESTARTS:-0}" "${rank_filter[@]}" --role rank --tee 3 -m dtrain.main "$@"
