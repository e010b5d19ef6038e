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
# Four decimal numbers 0 to 255, without leading zeros (which some resolvers read as octal).
valid_ipv4() {
    local octet='(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])'
    local re="^$octet\\.$octet\\.$octet\\.$octet\$"
    [[ "$1" =~ $re ]]
}
# An IPv6 literal, bracketed or not, with an optional %zone: eight groups of 1 to 4 hex digits, or fewer around one
# "::", the last two of which may be written as an IPv4 address.
valid_ipv6() {
    local address="$1" group='[0-9A-Fa-f]{1,4}' part colons count=0
    local groups="^$group(:$group)*\$" ipv4_tail='^(.*:)([0-9]+\.[0-9.]+)$'
    [[ "$address" =~ ^\[(.*)\]$ ]] && address="${BASH_REMATCH[1]}"
    address="${address%%\%*}"
    if [[ "$address" =~ $ipv4_tail ]]; then
        address="${BASH_REMATCH[1]}0:0"  # before valid_ipv4, whose own match replaces BASH_REMATCH
        valid_ipv4 "${BASH_REMATCH[2]}" || return 1
    fi
    if [[ "$address" != *::* ]]; then
        colons="${address//[^:]/}"
        [[ "$address" =~ $groups ]] && [ "${#colons}" = 7 ]
        return
    fi
    [[ "${address#*::}" != *::* ]] || return 1
    for part in "${address%%::*}" "${address#*::}"; do
        [ -z "$part" ] && continue
        [[ "$part" =~ $groups ]] || return 1
        colons="${part//[^:]/}"
        count=$((count + ${#colons} + 1))
    done
    [ "$count" -le 7 ]
}
# valid_address ADDRESS: an IPv4 address, an IPv6 literal, or a hostname (dot-separated labels of letters, digits
# and inner hyphens, RFC 1123; '_' too, which resolvers accept in cluster-made names). Checked before torchrun,
# which would try a malformed one for a minute and then fail with its own report.
valid_address() {
    local label='[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?'
    local hostname="^($label\\.)*$label\\.?\$"
    if [[ "$1" =~ ^[0-9.]+$ ]]; then
        valid_ipv4 "$1"  # all digits and dots: an IPv4 address or nothing (no top-level domain is numeric)
    elif [[ "$1" == *:* ]]; then
        valid_ipv6 "$1"
    else
        [ "${#1}" -le 253 ] && [[ "$1" =~ $hostname ]]
    fi
}
[[ "$nnodes" =~ ^[1-9][0-9]*$ ]] || launch_env_error NNODES "$nnodes" "use a number of nodes (1 or more)"
# The static rendezvous's variables, checked where they are used (a cluster may set them for other tools).
if [ "$nnodes" != 1 ] && [ -z "${RDZV_ENDPOINT:-}" ]; then
    if ! [[ "${NODE_RANK:-}" =~ ^(0|[1-9][0-9]*)$ ]] || [ "$NODE_RANK" -ge "$nnodes" ]; then
        launch_env_error NODE_RANK "${NODE_RANK:-}" "use this node's rank, 0 to $((nnodes - 1)) (NNODES=$nnodes)"
    fi
    [ -n "${MASTER_ADDR:-}" ] || launch_env_error MASTER_ADDR "" "use the first node's address (or set RDZV_ENDPOINT)"
    valid_address "$MASTER_ADDR" || launch_env_error MASTER_ADDR "$MASTER_ADDR" \
        "use the first node's hostname, IPv4 address or IPv6 literal (or set RDZV_ENDPOINT)"
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
