#!/bin/sh
# The library's own training job against its no-network floor, side by side in
# one run: the example trainer (C++ API; the C API is the same Reducer) on an
# emulated cluster of HOSTS network namespaces, once with every host's link
# shaped to RATE (tbf) and once unshaped (veth at memory speed: what the job
# costs when the network costs nothing). Runs alternate, ROUNDS of each; the
# figure is the median shaped time over the median unshaped one. Needs root.
# Usage: bench/network_floor.sh [BUILD_DIR] [HOSTS] [RATE] [ROUNDS] [-- trainer arguments]
#   e.g. bench/network_floor.sh build 4 1gbit 3
#   default trainer arguments: --model wide --rank 2 --start-iter 0 --epochs 1 --test-limit 2000
# Time: the trainer's own "epoch 1: ... N s" (from its first step to the end of
# the epoch's test pass: start-up and data loading excluded), rank 0.
set -eu
BUILD=${1:-build}
HOSTS=${2:-4}
RATE=${3:-1gbit}
ROUNDS=${4:-3}
if [ $# -gt 4 ]; then shift 4; else shift $#; fi
[ "${1:-}" = "--" ] && shift
if [ $# -eq 0 ]; then set -- --model wide --rank 2 --start-iter 0 --epochs 1 --test-limit 2000; fi
TRAIN_ARGS="$*"  # word-split again below: arguments without blanks
# shellcheck source=bench/emulated_preamble.sh
. "$(dirname "$0")/emulated_preamble.sh"
emulated_preamble network_floor.sh train
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
trap 'exit 130' INT  # dash runs the EXIT trap on exit, not when a signal ends it
trap 'exit 143' TERM

run() {  # label round [--link-rate RATE]
  label=$1 round=$2
  shift 2
  log="$tmp/$label-$round.log"
  # shellcheck disable=SC2086  # TRAIN_ARGS is a list of arguments
  "$RUN" --emulate-hosts "$HOSTS" "$@" -n "$HOSTS" --timeout 1800 --env PSGD_BLAS_THREADS=1 \
    --env OPENBLAS_NUM_THREADS=1 -- "$TRAIN" $TRAIN_ARGS > "$log" 2>&1 || {
    echo "network_floor.sh: the $label run $round failed; its output:" >&2
    cat "$log" >&2
    exit 1
  }
  seconds=$(sed -n 's/^\(\[0\] \)\{0,1\}epoch [0-9]*: .*, \([0-9.]*\) s, lr .*/\2/p' "$log" | tail -1)
  [ -n "$seconds" ] || { echo "network_floor.sh: no epoch line in the $label run $round" >&2; cat "$log" >&2; exit 1; }
  echo "$label $round $seconds $(cut -d' ' -f1 /proc/loadavg)" >> "$tmp/times"
  echo "| $label | $round | $seconds | $(cut -d' ' -f1 /proc/loadavg) |"
}
echo "== $HOSTS emulated hosts, $ROUNDS rounds; trainer: $*"
echo "| links | round | epoch time (s) | load avg |"
echo "| --- | --- | --- | --- |"
for round in $(seq "$ROUNDS"); do
  run "$RATE" "$round" --link-rate "$RATE"
  run unshaped "$round"
done
/usr/bin/python3 - "$tmp/times" "$RATE" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
shaped = [float(r[2]) for r in rows if r[0] == sys.argv[2]]
floor = [float(r[2]) for r in rows if r[0] == "unshaped"]
s, f = statistics.median(shaped), statistics.median(floor)
print(f"median epoch time: links at {sys.argv[2]} {s:.2f} s, unshaped (the no-network floor) {f:.2f} s: "
      f"{s / f:.3f}x the floor")
PY
