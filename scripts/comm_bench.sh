#!/usr/bin/env bash
# Time the collectives (all_reduce, the reference ring_all_reduce, all_gather, reduce_scatter, all_to_all) per
# message size over NPROC ranks; print one markdown table of time, algbw, busbw and a correctness check.
#   NPROC=4 ./scripts/comm_bench.sh
#   NPROC=8 ./scripts/comm_bench.sh --ops all_reduce,ring_all_reduce --sizes 4K,1M,64M --iters 50 --json out.json
# Arguments: see `./scripts/comm_bench.sh --help` and docs/collectives.md. gloo on CPU, NCCL on GPUs.
#
# Environment:
#   NPROC (alias NGPU)   processes on this machine; default: the number of GPUs, or 2 on CPU
#   NNODES, NODE_RANK    several machines (what the network between them gives): with RDZV_ENDPOINT (host:port,
#                        c10d rendezvous) or MASTER_ADDR/MASTER_PORT, as run_train.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh

nproc="${NPROC:-${NGPU:-}}"
if [ -z "$nproc" ]; then
    nproc="$(python -c 'import torch; print(torch.cuda.device_count() or 2)')"
fi
nnodes="${NNODES:-1}"

# Bad arguments get one line here, before torchrun starts any rank (exit 3: --help was answered).
check=0
python scripts/comm_bench.py --check_args "$@" || check=$?
if [ "$check" = 3 ]; then exit 0; fi
if [ "$check" != 0 ]; then exit "$check"; fi

# One thread per rank: the ranks share this machine's cores (and torchrun would say so on every run).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
launch_dir="$(mktemp -d)"  # private (0700): the single-node stores
trap 'rm -rf "$launch_dir"' EXIT
source scripts/rendezvous.sh "$launch_dir" comm_bench
# No output filter: only rank 0 prints (the table), and a failing rank's traceback stays visible. Wrong results
# are no crash: rank 0 prints its error line, leaves the file named below, and the exit status says it.
export COMM_BENCH_WRONG_FILE="$launch_dir/wrong"
python -m torch.distributed.run --nproc_per_node "$nproc" "${rendezvous[@]}" scripts/comm_bench.py "$@"
if [ -e "$COMM_BENCH_WRONG_FILE" ]; then exit 1; fi
