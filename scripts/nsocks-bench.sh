#!/usr/bin/env bash
# All-reduce busbw with HCOMM_NSOCKS=1, 2, 4 (docs/multi-host.md, "Several sockets per link").
#
#   scripts/nsocks-bench.sh loopback            # 2 local ranks over TCP
#   scripts/nsocks-bench.sh netns [RATE]        # 2 namespace hosts x 1 rank (root), e.g. 1gbit
#
# ROUNDS (default 3) rounds, each running k = 1, 2, 4 in turn (so that load from other jobs
# spreads over all three); rows go to OUT (default /tmp/nsocks-MODE[-RATE].jsonl) as
# {"nsocks":k,"round":r,"row":<hcomm bench --json row>}; a summary of medians is printed.
# Extra HCOMM_* variables in the environment (HCOMM_SOCKET_BUF, ...) reach every rank.
set -euo pipefail
cd "$(dirname "$0")/.."
H=$PWD/target/release/hcomm
S=$PWD/scripts/netns-cluster.sh
mode=${1:?loopback or netns}
rate=${2:-}
out=${OUT:-/tmp/nsocks-$mode${rate:+-$rate}.jsonl}
BENCH=(bench allreduce -b 1M -e 64M -f 4 -w 2 -n 5 --reps 3 -c 0 --json)
: >"$out"
if [ "$mode" = netns ]; then
    bash "$S" up 2 --prefix nb ${rate:+--rate "$rate"} >/dev/null
    trap 'bash "$S" down --prefix nb' EXIT
    export HCOMM_JOB_TOKEN=${HCOMM_JOB_TOKEN:-$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')}
fi
tag() { sed "s/^\[0\] //" | { grep '"bytes"' || true; } | sed "s/^/{\"nsocks\":$1,\"round\":$2,\"row\":/; s/\$/}/"; }
port=31000
for round in $(seq 1 "${ROUNDS:-3}"); do
    for k in 1 2 4; do
        port=$((port + 1))
        echo "round $round, HCOMM_NSOCKS=$k, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
        if [ "$mode" = loopback ]; then
            HCOMM_NSOCKS=$k "$H" "${BENCH[@]}" --np 2 --transport tcp 2>/dev/null | tag "$k" "$round" >>"$out"
        else
            for node in 1 0; do
                HCOMM_NSOCKS=$k HCOMM_SOCKET_IFNAME=10.77.0.0/24 bash "$S" exec "$node" --prefix nb -- \
                    "$H" run -n 1 --nnodes 2 --node-rank "$node" --master 10.77.0.10:$port -- "$H" "${BENCH[@]}" \
                    2>/dev/null | tag "$k" "$round" >>"$out" &
            done
            wait
        fi
    done
done
python3 - "$out" <<'PY'
import collections, json, statistics, sys
d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    j = json.loads(line)
    d[(j["row"]["bytes"], j["nsocks"])].append(j["row"]["busbw"])
print(sys.argv[1], "(busbw GB/s, median [all rounds])")
for b in sorted({k[0] for k in d}):
    cells = ["k=%d %.3f [%s]" % (k, statistics.median(d[(b, k)]), " ".join("%.2f" % x for x in d[(b, k)]))
             for k in (1, 2, 4) if (b, k) in d]
    print("  %3d MiB: %s" % (b >> 20, "  ".join(cells)))
PY
