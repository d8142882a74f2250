#!/usr/bin/env bash
# hcomm against the peer libraries of ../shared/bench (Open MPI, MPICH, oneCCL, torch gloo), in
# one run, with the same sizes, loop and columns, and the ratios side by side.
#
#   PEERS="openmpi oneccl gloo" RANKS=2 TRANSPORT=tcp SIZES=8,1m,64m COLLS=allreduce scripts/compare-peers.sh
#
# Settings (environment): PEERS, RANKS, TRANSPORT (tcp), SIZES (8, 1k, 1m, 64m, ...),
# COLLS (allreduce allgather reduce_scatter bcast barrier pingpong), REPS (timed repeats per
# size, median reported), TARGET (seconds per repeat), BENCH_DIR (default ../shared/bench),
# OUT_DIR (default results/), NOISE (busy processes running beside both hcomm and the peers,
# for hostile conditions; default 0), RETRY and PER_SIZE (below). The steal time of each half
# (/proc/stat) is printed with the table. Run it while nothing else uses the cores.
#
# On a VM the two vCPUs at times stop sharing a cache for seconds, and every shared-memory (and
# loopback TCP) figure moves 2-5x with it; a round that spans such a change is flagged NOT
# COMPARABLE. RETRY=N reruns a flagged round up to N times (all attempts are printed; the last
# one is the round's result); PER_SIZE=1 makes each size its own round (peers, then hcomm, for
# that size alone: a few seconds instead of tens, so fewer rounds span a change).
#
# ROUNDS=N runs every round N times, alternating which half goes first (peers first in the odd
# rounds, hcomm first in the even ones): whichever library runs second inherits the cache and
# frequency state the first left, so a single order would favour one side.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
RETRY=${RETRY:-0}
PER_SIZE=${PER_SIZE:-0}
ROUNDS=${ROUNDS:-1}
if ! [[ "$RETRY" =~ ^[0-9]+$ && "$ROUNDS" =~ ^[1-9][0-9]*$ ]]; then
    echo "compare-peers: RETRY must be a whole number and ROUNDS at least 1 (got RETRY=$RETRY ROUNDS=$ROUNDS)" >&2
    exit 2
fi
if [ -z "${_COMPARE_ROUND:-}" ] && { [ "$RETRY" -gt 0 ] || [ "$PER_SIZE" = 1 ] || [ "$ROUNDS" -gt 1 ]; }; then
    units=("${SIZES:-8,1m,64m}")
    [ "$PER_SIZE" = 1 ] && IFS=, read -r -a units <<<"${SIZES:-8,1m,64m}"
    out=$(mktemp)
    trap 'rm -f "$out"' EXIT
    status=0
    for round in $(seq 1 "$ROUNDS"); do
        first=peers
        [ $((round % 2)) = 0 ] && first=hcomm
        for unit in "${units[@]}"; do
            for attempt in $(seq 0 "$RETRY"); do
                echo "# round $round of $ROUNDS ($first first): sizes $unit, attempt $((attempt + 1)) of at most $((RETRY + 1))"
                _COMPARE_ROUND=1 _COMPARE_FIRST=$first SIZES="$unit" "$0" > "$out" || status=$?
                cat "$out"
                grep -q "^# NOT COMPARABLE" "$out" || break
            done
        done
    done
    exit "$status"
fi
BENCH_DIR=${BENCH_DIR:-$here/../shared/bench}
PEERS=${PEERS:-"openmpi oneccl gloo"}
RANKS=${RANKS:-2}
TRANSPORT=${TRANSPORT:-tcp}
SIZES=${SIZES:-8,1m,64m}
COLLS=${COLLS:-allreduce}
REPS=${REPS:-5}
TARGET=${TARGET:-0.05}
OUT_DIR=${OUT_DIR:-$here/results}
NOISE=${NOISE:-0}
if [ ! -x "$BENCH_DIR/peers.sh" ]; then
    echo "compare-peers: no peer benchmarks at $BENCH_DIR/peers.sh (set BENCH_DIR to the folder holding peers.sh)" >&2
    exit 2
fi
mkdir -p "$OUT_DIR"
stamp=$(date -u +%Y%m%dT%H%M%SZ)

(cd "$here" && cargo build --release -q -p hcomm-cli)
hcomm="$here/target/release/hcomm"

# Steal time between two samples of /proc/stat's cpu line, in percent of all CPU time.
cpu_sample() { awk '/^cpu /{t=0; for (i=2;i<=9;i++) t+=$i; print $9, t}' /proc/stat; }
steal_since() {
    local s0 t0 s1 t1
    read -r s0 t0 <<<"$1"
    read -r s1 t1 <<<"$(cpu_sample)"
    awk -v ds=$((s1 - s0)) -v dt=$((t1 - t0)) 'BEGIN { printf "%.1f", (dt > 0 ? 100 * ds / dt : 0) }'
}
# NOISE busy processes for the whole comparison (both halves see the same conditions).
noise_pids=()
for _ in $(seq 1 "$NOISE"); do
    (while :; do :; done) &
    noise_pids+=($!)
done
stop_noise() { [ ${#noise_pids[@]} -eq 0 ] || kill "${noise_pids[@]}" 2>/dev/null || true; }
trap stop_noise EXIT

# How long 256 KiB written on one CPU takes to be read on another, in µs (`hcomm bench` measures
# it for its header; a 1-rank run does nothing else): on a VM it jumps 3-5x while the hypervisor
# runs the vCPUs where they share no cache, and shared-memory figures (the peers' too) with it.
cross_core() {
    "$hcomm" bench allreduce -np 1 -b 8 -e 8 -n 1 -w 0 -c 0 2>/dev/null |
        sed -n 's/^# cross-core: .* in \([0-9.]*\) µs.*/\1/p' | head -1
}

run_peers() {
    echo "[compare] peers: $PEERS (ranks $RANKS, $TRANSPORT, sizes $SIZES, colls $COLLS, noise $NOISE)" >&2
    local start
    start=$(cpu_sample)
    BENCH_BUILD="$OUT_DIR/peer-build" BENCH_RESULTS="$OUT_DIR" PEERS="$PEERS" RANKS="$RANKS" \
        TRANSPORTS="$TRANSPORT" SIZES="$SIZES" COLLS="${COLLS// /,}" REPS="$REPS" TARGET="$TARGET" RUNS=1 \
        "$BENCH_DIR/peers.sh" > "$OUT_DIR/peers-$stamp.txt"
    peer_steal=$(steal_since "$start")
}

# hcomm runs in a private loopback-only network namespace too, as peers.sh runs the peers.
runner=()
ns="hcommcmp$$"
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null && ip netns add "$ns" 2>/dev/null; then
    trap 'stop_noise; ip netns del "$ns" 2>/dev/null || true' EXIT
    ip -n "$ns" link set lo up
    runner=(ip netns exec "$ns")
fi

to_bytes() {
    local s=${1,,}
    case "$s" in
        *k) echo $(( ${s%k} * 1024 )) ;;
        *m) echo $(( ${s%m} * 1024 * 1024 )) ;;
        *g) echo $(( ${s%g} * 1024 * 1024 * 1024 )) ;;
        *) echo "$s" ;;
    esac
}
hcomm_op() {
    case "$1" in
        allreduce) echo allreduce ;; allgather) echo allgather ;; reduce_scatter) echo reducescatter ;;
        bcast) echo broadcast ;; barrier) echo barrier ;; pingpong) echo sendrecv ;; *) echo "$1" ;;
    esac
}
json="$OUT_DIR/hcomm-$stamp.jsonl"
run_hcomm() {
    : > "$json"
    echo "[compare] hcomm" >&2
    local start coll size b
    start=$(cpu_sample)
    for coll in ${COLLS//,/ }; do
        for size in ${SIZES//,/ }; do
            b=$(to_bytes "$size")
            [ "$coll" = barrier ] && b=0
            "${runner[@]}" "$hcomm" bench "$(hcomm_op "$coll")" -np "$RANKS" -b "$b" -e "$b" -w 5 \
                --transport "$TRANSPORT" --target "$TARGET" --reps "$REPS" -c 1 --json | sed "s/^{/{\"coll\":\"$coll\",/" >> "$json"
        done
    done
    hcomm_steal=$(steal_since "$start")
}

# The two halves, peers first unless ROUNDS made this an hcomm-first round; the cross-core turn
# before each and after both.
first=${_COMPARE_FIRST:-peers}
second=hcomm
[ "$first" = hcomm ] && second=peers
cc_first=$(cross_core)
"run_$first"
cc_second=$(cross_core)
"run_$second"
cc_end=$(cross_core)
echo "# conditions: $NOISE busy process(es) beside the ranks; steal time $peer_steal% while the peers ran, $hcomm_steal% while hcomm ran (/proc/stat); $first ran first"
echo "# cross-core turn (256 KiB written on one CPU, read on another): ${cc_first:-?} µs before $first, ${cc_second:-?} before $second, ${cc_end:-?} after; a jump of 3x or more means the VM's CPUs stopped sharing a cache meanwhile, and shared-memory times are not comparable"
# Flag a comparison across states (turns more than 2x apart), as `hcomm bench --results` does.
if [ -n "$cc_first" ] && [ -n "$cc_second" ] && [ -n "$cc_end" ] &&
    ! awk -v a="$cc_first" -v b="$cc_second" -v c="$cc_end" 'BEGIN {
        lo = a; hi = a; if (b < lo) lo = b; if (c < lo) lo = c; if (b > hi) hi = b; if (c > hi) hi = c
        exit !(hi <= 2 * lo) }'; then
    echo "# NOT COMPARABLE: the machine changed state between or during the halves (the turns above differ by more than 2x): rerun this round"
fi

python3 - "$OUT_DIR/peers-$stamp.txt" "$json" <<'PY'
import json, sys
peers = {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) == 10 and f[0] != "peer":
        peer, coll, ranks, tr, nbytes, runs, t, tmin, algbw, busbw = f
        peers[(peer, coll, int(nbytes))] = (float(t), float(tmin), float(busbw))
rows = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
names = sorted({p for (p, _, _) in peers})
print(f"{'coll':<15}{'bytes':>10}  {'hcomm us':>10} {'busbw':>7}  " + "  ".join(f"{n + ' us':>13} {'busbw':>6} {'x':>5}" for n in names))
for r in rows:
    coll, nb = r["coll"], r["bytes"]
    cells = []
    for n in names:
        # peers.sh reports the block-rounded size; match the nearest entry.
        cand = [k for k in peers if k[0] == n and k[1] == coll]
        k = min(cand, key=lambda k: abs(k[2] - nb), default=None)
        if k is None:
            cells.append(f"{'-':>13} {'-':>6} {'-':>5}")
            continue
        t, _, bw = peers[k]
        ratio = t / r["time_us"] if r["time_us"] > 0 else 0
        cells.append(f"{t:>13.2f} {bw:>6.2f} {ratio:>5.2f}")
    wrong = "" if r["wrong"] == 0 else f"  WRONG={r['wrong']}"
    print(f"{coll:<15}{nb:>10}  {r['time_us']:>10.2f} {r['busbw']:>7.2f}  " + "  ".join(cells) + wrong)
print("x = peer time / hcomm time (above 1: hcomm is faster); times are medians of repeats, max over ranks")
PY
