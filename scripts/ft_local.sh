#!/usr/bin/env bash
# Fault-tolerant training on one machine: torchft's lighthouse and FT_GROUPS replica groups, each an ordinary
# ./run_train.sh launch with its own replica id and run folder (docs/fault-tolerance.md).
#   ./scripts/ft_local.sh --training.steps 100
#   FT_GROUPS=3 NPROC=2 ./scripts/ft_local.sh --job.dump_folder outputs/ft3 --parallelism.data_parallel_shard_degree 2
#
# The arguments go to every group. Group i trains in <base>/replica_<i> and writes its output to train.log there;
# <base> is the --job.dump_folder given here (default outputs/ft; a config file's is not read). The script waits
# for every group, then stops the lighthouse; Ctrl-C or kill (SIGTERM) stops the groups (they save, as a single
# run does) and the lighthouse. It exits with the first failed group's status.
#
# Environment:
#   FT_GROUPS            replica groups (default 2; not GROUPS, which bash reserves)
#   NPROC                processes per group (default 1)
#   FT_MIN_REPLICAS      groups a step needs: the lighthouse's --min_replicas and fault_tolerance.min_replica_size
#                        (default 1: the job goes on while one group is alive)
#   FT_LIGHTHOUSE_PORT   the lighthouse's port on 127.0.0.1 (default: a free one)
#   OMP_NUM_THREADS      threads per process (default: the cores shared out, max(1, cores / (FT_GROUPS * NPROC)):
#                        processes spinning on more threads than the cores make every step many times slower)
set -euo pipefail
repo_root="$(cd "$(dirname "$0")/.." && pwd)"
nnodes=1
source "$repo_root/scripts/rendezvous.sh" --check  # launch_env_error: one line naming the variable, exit code 2

groups="${FT_GROUPS:-2}"
nproc="${NPROC:-1}"
min_replicas="${FT_MIN_REPLICAS:-1}"
port="${FT_LIGHTHOUSE_PORT:-}"
[[ "$groups" =~ ^[1-9][0-9]*$ ]] || launch_env_error FT_GROUPS "$groups" "use a number of replica groups (1 or more)"
[[ "$nproc" =~ ^[1-9][0-9]*$ ]] || launch_env_error NPROC "$nproc" "use a number of processes per group (1 or more)"
if ! [[ "$min_replicas" =~ ^[1-9][0-9]*$ ]] || [ "$min_replicas" -gt "$groups" ]; then
    launch_env_error FT_MIN_REPLICAS "$min_replicas" "use 1 to FT_GROUPS ($groups)"
fi
if [ -n "$port" ] && { ! [[ "$port" =~ ^[1-9][0-9]{0,4}$ ]] || [ "$port" -gt 65535 ]; }; then
    launch_env_error FT_LIGHTHOUSE_PORT "$port" "use a TCP port, 1 to 65535"
fi

base=outputs/ft
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do  # the last --job.dump_folder wins, as on run_train.sh's command line
    case "${args[i]}" in
        --job.dump_folder) base="${args[i + 1]:-$base}" ;;
        --job.dump_folder=*) base="${args[i]#*=}" ;;
    esac
done
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / (groups * nproc) > 1 ? $(nproc) / (groups * nproc) : 1 ))}"

source "$repo_root/scripts/setup_env.sh"
command -v torchft_lighthouse >/dev/null || {
    echo "error: torchft_lighthouse not found: install torchft (DTRAIN_EXTRAS=ft ./scripts/setup_env.sh)" >&2
    exit 2
}
port="${port:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
mkdir -p "$base"

# Each group and the lighthouse run in a session of their own: Ctrl-C reaches this script alone, which stops the
# groups once (SIGTERM: they save) before the lighthouse they need, then removes whatever a group left running.
pids=()
stop() {
    trap '' INT TERM
    echo "ft_local.sh: stopping the replica groups and the lighthouse" >&2
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for _ in $(seq 600); do  # up to 60 s for their saves
        running=0
        for pid in "${pids[@]}"; do alive "$pid" && running=1; done
        [ "$running" = 1 ] || break
        sleep 0.1
    done
    cleanup
    exit 130
}
alive() {  # running, not an exited child waiting to be reaped
    local state
    state="$(ps -o stat= -p "$1" 2>/dev/null)" && [[ "$state" != Z* ]]
}
cleanup() {
    for pid in "${pids[@]}" "${lighthouse_pid:-}"; do
        [ -n "$pid" ] && kill -KILL -- "-$pid" 2>/dev/null || true
    done
}
trap stop INT TERM
trap cleanup EXIT

# Its warnings go to lighthouse.log (RUST_LOG=info: every quorum); a group is dropped 1 s after its last heartbeat.
RUST_LOG="${RUST_LOG:-warn}" setsid torchft_lighthouse --min_replicas "$min_replicas" --bind "127.0.0.1:$port" \
    --join_timeout_ms 1000 --heartbeat_timeout_ms 1000 >"$base/lighthouse.log" 2>&1 &
lighthouse_pid=$!
for _ in $(seq 100); do  # up within 10 s, or its log says why not
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
    kill -0 "$lighthouse_pid" 2>/dev/null || break
    sleep 0.1
done
(exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || {
    echo "error: torchft's lighthouse did not start on 127.0.0.1:$port: $(tail -n 1 "$base/lighthouse.log")" >&2
    exit 1
}
echo "ft_local.sh: lighthouse on http://127.0.0.1:$port; $groups replica groups of $nproc process(es)," \
    "OMP_NUM_THREADS=$OMP_NUM_THREADS" >&2

for ((g = 0; g < groups; g++)); do
    mkdir -p "$base/replica_$g"
    NPROC="$nproc" TORCHFT_LIGHTHOUSE="http://127.0.0.1:$port" setsid "$repo_root/run_train.sh" \
        --fault_tolerance.min_replica_size "$min_replicas" "$@" --fault_tolerance.enable \
        --fault_tolerance.group_size "$groups" --fault_tolerance.replica_id "$g" \
        --job.dump_folder "$base/replica_$g" >"$base/replica_$g/train.log" 2>&1 &
    pids+=($!)
    echo "ft_local.sh: replica group $g: pid $!, log $base/replica_$g/train.log" >&2
done

status=0
for ((g = 0; g < groups; g++)); do
    code=0
    wait "${pids[g]}" || code=$?
    if [ "$code" = 0 ]; then
        echo "ft_local.sh: replica group $g done" >&2
    else
        echo "ft_local.sh: replica group $g failed (exit $code): $(tail -n 1 "$base/replica_$g/train.log")" >&2
        [ "$status" != 0 ] || status=$code
    fi
done
exit "$status"
