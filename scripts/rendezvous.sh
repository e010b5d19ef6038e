# Sourced by run_train.sh and scripts/comm_bench.sh: sets the torchrun `rendezvous` arguments for this launch.
#   source scripts/rendezvous.sh LAUNCH_DIR RDZV_ID      (with nnodes set; reads RDZV_ENDPOINT, NODE_RANK, MASTER_*)
#   source scripts/rendezvous.sh --check                 only checks nnodes, NODE_RANK, MASTER_ADDR and MASTER_PORT
# A bad value ends the launch with one line naming the variable and exit code 2 (a config error's), before
# anything starts or is written.
# One machine: nothing listens beyond loopback. torchrun's own TCP store would listen on every interface with no
# authentication, so the agent's rendezvous and the workers' store are files in the private launch folder, and
# gloo and NCCL bind to the loopback interface (see docs/reliability.md).

# launch_env_error NAME VALUE WHAT_IS_VALID: also used by run_train.sh for its own variables.
launch_env_error() {
    echo "error: $1='$2' is not valid: $3" >&2
    exit 2
}
[[ "$nnodes" =~ ^[1-9][0-9]*$ ]] || launch_env_error NNODES "$nnodes" "use a number of nodes (1 or more)"
# The static rendezvous's variables, checked where they are used (a cluster may set them for other tools).
if [ "$nnodes" != 1 ] && [ -z "${RDZV_ENDPOINT:-}" ]; then
    if ! [[ "${NODE_RANK:-}" =~ ^(0|[1-9][0-9]*)$ ]] || [ "$NODE_RANK" -ge "$nnodes" ]; then
        launch_env_error NODE_RANK "${NODE_RANK:-}" "use this node's rank, 0 to $((nnodes - 1)) (NNODES=$nnodes)"
    fi
    [ -n "${MASTER_ADDR:-}" ] || launch_env_error MASTER_ADDR "" "use the first node's address (or set RDZV_ENDPOINT)"
    if ! [[ "${MASTER_PORT:-29500}" =~ ^[1-9][0-9]{0,4}$ ]] || [ "${MASTER_PORT:-29500}" -gt 65535 ]; then
        launch_env_error MASTER_PORT "$MASTER_PORT" "use a TCP port, 1 to 65535"
    fi
fi
if [ "$1" = --check ]; then return 0; fi

rdzv_launch_dir="$1"
rdzv_id="$2"
if [ "$nnodes" = "1" ]; then
    rendezvous=(--nnodes 1 --rdzv_backend c10d --rdzv_endpoint "$rdzv_launch_dir/rendezvous" --rdzv_conf store_type=file
        --rdzv_id "$rdzv_id")
    export DTRAIN_STORE_FILE="$rdzv_launch_dir/store" GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}" \
        NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
elif [ -n "${RDZV_ENDPOINT:-}" ]; then
    rendezvous=(--nnodes "$nnodes" --rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT" --rdzv_id "${RDZV_ID:-$rdzv_id}")
else
    rendezvous=(--nnodes "$nnodes" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR"
        --master_port "${MASTER_PORT:-29500}")
fi
