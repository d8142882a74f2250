#!/usr/bin/env bash
# A cluster of "hosts" on one machine: network namespaces joined by veth pairs to a bridge
# that lives in its own namespace, in a private subnet that exists only inside them.
#
#   scripts/netns-cluster.sh up HOSTS [--rate RATE] [--prefix P]   # e.g. up 2 --rate 1gbit
#   scripts/netns-cluster.sh exec HOST_INDEX [--prefix P] -- CMD ARGS...
#   scripts/netns-cluster.sh addr HOST_INDEX                        # the host's address
#   scripts/netns-cluster.sh down [--prefix P]
#
# Host i is namespace "${P}h$i" with address 10.77.0.(10+i)/24 on its eth0; the bridge is in
# "${P}sw". --rate shapes every host's egress with tc tbf (netem is not available on these
# kernels). `exec` runs CMD in host i's namespace with HCOMM_HOST_ID set to the host's name
# (the namespaces share the machine's hostname and boot id, which hcomm would otherwise use to
# recognise one host). Needs root (or CAP_NET_ADMIN) and iproute2. `down` removes everything
# with the prefix and is safe to run twice.
set -euo pipefail

cmd=${1:-}
shift || true
prefix=hc
rate=""
hosts=""
index=""
rest=()
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) prefix=$2; shift 2 ;;
        --rate) rate=$2; shift 2 ;;
        --) shift; rest=("$@"); break ;;
        *)
            if [ -z "$hosts" ] && [ -z "$index" ]; then
                hosts=$1; index=$1; shift
            else
                echo "netns-cluster: unexpected argument '$1'" >&2; exit 2
            fi ;;
    esac
done

subnet=10.77.0
addr_of() { echo "$subnet.$((10 + $1))"; }

down() {
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${prefix}(h[0-9]+|sw)$" || true); do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
}

case "$cmd" in
    up)
        [[ "$hosts" =~ ^[0-9]+$ ]] && [ "$hosts" -ge 1 ] && [ "$hosts" -le 200 ] ||
            { echo "netns-cluster: up needs a host count (1-200)" >&2; exit 2; }
        down
        trap 'echo "netns-cluster: setup failed, cleaning up" >&2; down' ERR
        ip netns add "${prefix}sw"
        ip -n "${prefix}sw" link add br0 type bridge
        ip -n "${prefix}sw" link set br0 up
        ip -n "${prefix}sw" link set lo up
        for ((i = 0; i < hosts; i++)); do
            ns="${prefix}h$i"
            ip netns add "$ns"
            ip -n "$ns" link set lo up
            # Create the pair inside the host namespace, then move the far end to the switch.
            ip -n "$ns" link add eth0 type veth peer name "p$i"
            ip -n "$ns" link set "p$i" netns "${prefix}sw"
            ip -n "${prefix}sw" link set "p$i" master br0
            ip -n "${prefix}sw" link set "p$i" up
            ip -n "$ns" addr add "$(addr_of "$i")/24" dev eth0
            ip -n "$ns" link set eth0 up
            if [ -n "$rate" ]; then
                ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 512kb latency 100ms
            fi
        done
        trap - ERR
        echo "netns-cluster: $hosts host(s) ${prefix}h0..${prefix}h$((hosts - 1)), $subnet.10-$((9 + hosts))${rate:+, $rate per host}"
        ;;
    exec)
        [[ "$index" =~ ^[0-9]+$ ]] || { echo "netns-cluster: exec needs a host index" >&2; exit 2; }
        [ ${#rest[@]} -gt 0 ] || { echo "netns-cluster: exec needs -- CMD" >&2; exit 2; }
        exec ip netns exec "${prefix}h$index" env HCOMM_HOST_ID="${prefix}h$index" "${rest[@]}"
        ;;
    addr)
        addr_of "$index"
        ;;
    down)
        down
        ;;
    *)
        sed -n '2,16p' "$0" >&2
        exit 2
        ;;
esac
