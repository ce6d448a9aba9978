#!/bin/sh
# How long Communicator::create takes at a distance, two builds side by side (issue 28): emulated clusters of
# HOSTS hosts (one rank each, links shaped to RATE, --link-delay one way into each host); every rank runs
# launcher_worker direct-bound (create, then two checked allreduces), which prints create_ms, the time its
# create() took (with the argument `channels`, which the channel metrics below pass, also remeasured_ms and
# channel_ms). The table gives per build the median over ROUNDS rounds of the slowest rank's metric, and the
# median of the per-round ratios old / new; the builds alternate within each round. Needs root.
# Usage: bench/create_ab.sh OLD_BUILD [NEW_BUILD] [RATE] [ROUNDS]
#   OLD_BUILD, NEW_BUILD: build directories with tests/multiprocess/launcher_worker (NEW_BUILD also with the
#   launcher); the worker must print create_ms (since 2026-12-06: in an older commit, apply that line).
# Environment (defaults in brackets): HOSTS ["8 16"]  DELAYS ["5ms 25ms"]
#   METRIC [create_ms]: or destroy_ms, how long the communicator's destruction took (the slowest rank's; the
#   worker prints it since 2026-12-06, the same way), or channel_ms, how long Communicator::create_channel
#   took (since 2026-12-07), or remeasured_ms, a second group of the same ranks made with the first's options
#   and a run id of its own (channels before create_channel: it measures its own direct bound)
#   OLD_METRIC [METRIC]: the old side's metric, so that one build compares two (e.g. OLD_METRIC=remeasured_ms
#   METRIC=channel_ms bench/create_ab.sh build build)
set -eu
OLD_BUILD=${1:?usage: bench/create_ab.sh OLD_BUILD [NEW_BUILD] [RATE] [ROUNDS]}
BUILD=${2:-build}
RATE=${3:-1gbit}
ROUNDS=${4:-3}
HOSTS=${HOSTS:-8 16}
DELAYS=${DELAYS:-5ms 25ms}
METRIC=${METRIC:-create_ms}
OLD_METRIC=${OLD_METRIC:-$METRIC}
for m in "$METRIC" "$OLD_METRIC"; do
  case $m in
    create_ms | destroy_ms | channel_ms | remeasured_ms) ;;
    *) echo "create_ab.sh: METRIC and OLD_METRIC are create_ms, destroy_ms, channel_ms or remeasured_ms, not '$m'" >&2
       exit 2 ;;
  esac
done
# shellcheck source=bench/emulated_preamble.sh
. "$(dirname "$0")/emulated_preamble.sh"
emulated_preamble create_ab.sh
for b in "$OLD_BUILD" "$BUILD"; do
  [ -x "$b/tests/multiprocess/launcher_worker" ] || {
    echo "create_ab.sh: $b/tests/multiprocess/launcher_worker not found (ninja -C $b tests/multiprocess/launcher_worker)" >&2
    exit 2
  }
done

# The slowest rank's metric ($4) of one run; fails where a rank's allreduce was wrong or the metric is missing.
slowest() {
  case $4 in channel_ms | remeasured_ms) channels=channels ;; *) channels= ;; esac
  # shellcheck disable=SC2086 # $channels: no argument where empty
  out=$("$RUN" --emulate-hosts "$1" -n "$1" --timeout 300 --link-rate "$RATE" --link-delay "$2" -- \
    "$3/tests/multiprocess/launcher_worker" direct-bound $channels 2>&1) || { echo "$out" >&2; return 1; }
  echo "$out" | awk -v n="$1" -v metric="$4" '
    /direct_bound=/ { if ($0 !~ /wrong=0/) bad = 1; if (match($0, metric "=[0-9.]+")) {
                        v = substr($0, RSTART + length(metric) + 1, RLENGTH - length(metric) - 1) + 0; seen++
                        if (v > max) max = v } }
    END { if (bad || seen != n) exit 1; print max }'
}

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

echo "| hosts | one-way delay | old $OLD_METRIC | new $METRIC | old / new |"
echo "| --- | --- | --- | --- | --- |"
for h in $HOSTS; do
  for d in $DELAYS; do
    olds='' news='' ratios=''
    r=0
    while [ "$r" -lt "$ROUNDS" ]; do
      old=$(slowest "$h" "$d" "$OLD_BUILD" "$OLD_METRIC")
      new=$(slowest "$h" "$d" "$BUILD" "$METRIC")
      olds="$olds $old" news="$news $new"
      ratios="$ratios $(awk -v a="$old" -v b="$new" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "inf" }')"
      r=$((r + 1))
    done
    printf '| %s | %s | %s | %s | %sx |\n' "$h" "$d" \
      "$(echo "$olds" | tr ' ' '\n' | grep . | median)" "$(echo "$news" | tr ' ' '\n' | grep . | median)" \
      "$(echo "$ratios" | tr ' ' '\n' | grep . | median)"
  done
done
