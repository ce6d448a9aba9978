#!/bin/sh
# How long Communicator::create takes at a distance, two builds side by side (issue 28): emulated clusters of
# HOSTS hosts (one rank each, links shaped to RATE, --link-delay one way into each host); every rank runs
# launcher_worker direct-bound (create, then two checked allreduces), which prints create_ms, the time its
# create() took. The table gives per build the median over ROUNDS rounds of the slowest rank's create_ms, and
# the median of the per-round ratios old / new; the builds alternate within each round. Needs root.
# Usage: bench/create_ab.sh OLD_BUILD [NEW_BUILD] [RATE] [ROUNDS]
#   OLD_BUILD, NEW_BUILD: build directories with tests/multiprocess/launcher_worker (NEW_BUILD also with the
#   launcher); the worker must print create_ms (since 2026-12-06: in an older commit, apply that line).
# Environment (defaults in brackets): HOSTS ["8 16"]  DELAYS ["5ms 25ms"]
#   METRIC [create_ms]: or destroy_ms, how long the communicator's destruction took (the slowest rank's; the
#   worker prints it since 2026-12-06, the same way)
set -eu
OLD_BUILD=${1:?usage: bench/create_ab.sh OLD_BUILD [NEW_BUILD] [RATE] [ROUNDS]}
BUILD=${2:-build}
RATE=${3:-1gbit}
ROUNDS=${4:-3}
HOSTS=${HOSTS:-8 16}
DELAYS=${DELAYS:-5ms 25ms}
METRIC=${METRIC:-create_ms}
case $METRIC in
  create_ms | destroy_ms) ;;
  *) echo "create_ab.sh: METRIC is create_ms or destroy_ms, not '$METRIC'" >&2; exit 2 ;;
esac
# shellcheck source=bench/emulated_preamble.sh
. "$(dirname "$0")/emulated_preamble.sh"
emulated_preamble create_ab.sh
for b in "$OLD_BUILD" "$BUILD"; do
  [ -x "$b/tests/multiprocess/launcher_worker" ] || {
    echo "create_ab.sh: $b/tests/multiprocess/launcher_worker not found (ninja -C $b tests/multiprocess/launcher_worker)" >&2
    exit 2
  }
done

# The slowest rank's METRIC of one run; fails where a rank's allreduce was wrong or METRIC is missing.
slowest() {
  out=$("$RUN" --emulate-hosts "$1" -n "$1" --timeout 300 --link-rate "$RATE" --link-delay "$2" -- \
    "$3/tests/multiprocess/launcher_worker" direct-bound 2>&1) || { echo "$out" >&2; return 1; }
  echo "$out" | awk -v n="$1" -v metric="$METRIC" '
    /direct_bound=/ { if ($0 !~ /wrong=0/) bad = 1; if (match($0, metric "=[0-9.]+")) {
                        v = substr($0, RSTART + length(metric) + 1, RLENGTH - length(metric) - 1) + 0; seen++
                        if (v > max) max = v } }
    END { if (bad || seen != n) exit 1; print max }'
}

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

echo "| hosts | one-way delay | old $METRIC | new $METRIC | old / new |"
echo "| --- | --- | --- | --- | --- |"
for h in $HOSTS; do
  for d in $DELAYS; do
    olds='' news='' ratios=''
    r=0
    while [ "$r" -lt "$ROUNDS" ]; do
      old=$(slowest "$h" "$d" "$OLD_BUILD")
      new=$(slowest "$h" "$d" "$BUILD")
      olds="$olds $old" news="$news $new"
      ratios="$ratios $(awk -v a="$old" -v b="$new" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "inf" }')"
      r=$((r + 1))
    done
    printf '| %s | %s | %s | %s | %sx |\n' "$h" "$d" \
      "$(echo "$olds" | tr ' ' '\n' | grep . | median)" "$(echo "$news" | tr ' ' '\n' | grep . | median)" \
      "$(echo "$ratios" | tr ' ' '\n' | grep . | median)"
  done
done
