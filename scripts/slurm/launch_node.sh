#!/usr/bin/env bash
# One SLURM task per node runs this (scripts/slurm/train.sbatch starts it with srun): it turns the SLURM
# environment into run_train.sh's and becomes run_train.sh, which starts torchrun for this node's processes.
#   srun --ntasks-per-node=1 scripts/slurm/launch_node.sh --config llama3_8b --training.steps 10
#
# From SLURM (the step's nodes, else the job's):
#   NNODES          SLURM_STEP_NUM_NODES, else SLURM_NNODES
#   RDZV_ENDPOINT   the first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST (`scontrol show hostnames`), port
#                   RDZV_PORT (default 29500 + SLURM_JOB_ID % 1000, so that jobs sharing a node do not collide):
#                   torchrun's c10d rendezvous, whose store the agent on that host serves
#   RDZV_ID         dtrain-$SLURM_JOB_ID
#   NPROC           processes on this node: kept if set (or NGPU); else SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE
#                   ([type:]count), the devices in CUDA_VISIBLE_DEVICES; else run_train.sh's default (the GPUs
#                   torch sees, 1 on CPU)
# DTRAIN_ROOT names the checkout whose run_train.sh runs (default: the one holding this script).
# DTRAIN_NO_INSTALL=1 (unless set): run_train.sh uses the Python environment built on the login node
# (./scripts/setup_env.sh) and never creates or installs one here (scripts/setup_env.sh).
set -euo pipefail

fail() {
    echo "error: $*" >&2
    exit 2
}

for name in SLURM_JOB_ID SLURM_NNODES SLURM_JOB_NODELIST; do
    [ -n "${!name:-}" ] || fail "$name is not set: scripts/slurm/launch_node.sh runs as a task of a SLURM job" \
        "(sbatch scripts/slurm/train.sbatch ..., or srun --ntasks-per-node=1 inside salloc)"
done
[[ "$SLURM_JOB_ID" =~ ^[0-9]+$ ]] || fail "SLURM_JOB_ID='$SLURM_JOB_ID' is not a job number"
nnodes="${SLURM_STEP_NUM_NODES:-$SLURM_NNODES}"
nodelist="${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}"
[[ "$nnodes" =~ ^[1-9][0-9]*$ ]] || fail "SLURM_NNODES='$nnodes' is not a node count"
command -v scontrol >/dev/null || fail "scontrol is not on PATH: it expands the node list '$nodelist'" \
    "(run inside a SLURM job, on a node with SLURM's client tools)"
hosts="$(scontrol show hostnames "$nodelist" 2>&1)" || fail "scontrol show hostnames '$nodelist' failed:" \
    "$(head -n1 <<< "$hosts")"
count="$(grep -c . <<< "$hosts" || true)"
[ "$count" = "$nnodes" ] || fail "the node list '$nodelist' names $count host(s), but SLURM_NNODES=$nnodes"
port="${RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}"
{ [[ "$port" =~ ^[0-9]+$ ]] && [ "$port" -ge 1 ] && [ "$port" -le 65535 ]; } || fail "RDZV_PORT='$port' is not a port"

gpus_on_this_node() {
    local per_node="${SLURM_GPUS_PER_NODE:-}"
    if [ -n "${SLURM_GPUS_ON_NODE:-}" ] && [ "$SLURM_GPUS_ON_NODE" != 0 ]; then
        [[ "$SLURM_GPUS_ON_NODE" =~ ^[1-9][0-9]*$ ]] || fail "SLURM_GPUS_ON_NODE='$SLURM_GPUS_ON_NODE' is not a count"
        echo "$SLURM_GPUS_ON_NODE"
    elif [ -n "$per_node" ]; then
        [[ "${per_node##*:}" =~ ^[1-9][0-9]*$ ]] || fail "SLURM_GPUS_PER_NODE='$per_node' is not [type:]count"
        echo "${per_node##*:}"
    elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
        tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .
    fi
}

if [ -z "${NPROC:-${NGPU:-}}" ]; then
    gpus="$(gpus_on_this_node)"
    if [ -n "$gpus" ]; then export NPROC="$gpus"; fi
fi
export NNODES="$nnodes" RDZV_ENDPOINT="$(head -n1 <<< "$hosts"):$port" RDZV_ID="dtrain-$SLURM_JOB_ID"
export DTRAIN_NO_INSTALL="${DTRAIN_NO_INSTALL:-1}"
root="${DTRAIN_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
[ -x "$root/run_train.sh" ] || fail "no run_train.sh in '$root': set DTRAIN_ROOT to the dtrain checkout"

# exec, here and in run_train.sh: this task's process becomes the launcher that forwards signals to torchrun.
# SLURM sends SIGTERM (scancel, --signal, preemption, the time limit) only to a step's task processes, so the
# launcher gets it once and every worker saves and exits (docs/cluster.md#preemption-and-time-limits).
exec "$root/run_train.sh" "$@"
