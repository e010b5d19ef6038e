# Sourced by run_train.sh and scripts/comm_bench.sh: sets the torchrun `rendezvous` arguments for this launch.
#   source scripts/rendezvous.sh LAUNCH_DIR RDZV_ID      (with nnodes set; reads RDZV_ENDPOINT, NODE_RANK, MASTER_*)
# One machine: nothing listens beyond loopback. torchrun's own TCP store would listen on every interface with no
# authentication, so the agent's rendezvous and the workers' store are files in the private launch folder, and
# gloo and NCCL bind to the loopback interface (see docs/reliability.md).
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
    rendezvous=(--nnodes "$nnodes" --node_rank "${NODE_RANK:?NODE_RANK is needed with NNODES > 1}"
        --master_addr "${MASTER_ADDR:?MASTER_ADDR or RDZV_ENDPOINT is needed with NNODES > 1}"
        --master_port "${MASTER_PORT:-29500}")
fi
