#!/bin/sh
# Bandwidth-bound training, side by side in one run: the example trainer on an
# emulated cluster (N network namespaces, each link shaped to RATE with tbf),
# once with PowerSGD and once with a plain averaged allreduce. Needs root.
# Usage: bench/emulated_training.sh [BUILD_DIR] [HOSTS] [RATE] [EPOCHS]
#   e.g. bench/emulated_training.sh build 4 100mbit 1
# TRAIN_EXTRA: more trainer arguments for both runs, without blanks (e.g. "--submit each").
set -eu
BUILD=${1:-build}
HOSTS=${2:-4}
RATE=${3:-100mbit}
EPOCHS=${4:-1}
# shellcheck source=bench/emulated_preamble.sh
. "$(dirname "$0")/emulated_preamble.sh"
emulated_preamble emulated_training.sh train

run() {  # label, trainer arguments...
  label=$1
  shift
  start=$(date +%s.%N)
  # shellcheck disable=SC2086  # TRAIN_EXTRA: a list of arguments without blanks
  "$RUN" --emulate-hosts "$HOSTS" --link-rate "$RATE" -n "$HOSTS" --timeout 1800 --env PSGD_BLAS_THREADS=1 \
    --env OPENBLAS_NUM_THREADS=1 -- "$TRAIN" --epochs "$EPOCHS" ${TRAIN_EXTRA:-} "$@" | sed "s/^/$label /"
  end=$(date +%s.%N)
  echo "$label wall $(awk "BEGIN {printf \"%.1f\", $end - $start}") s"
}
echo "== $HOSTS emulated hosts, links shaped to $RATE, $EPOCHS epoch(s)"
run powersgd --rank 4 > /tmp/psgd-emulated-ours.$$
run allreduce --no-compression > /tmp/psgd-emulated-plain.$$
cat /tmp/psgd-emulated-ours.$$ /tmp/psgd-emulated-plain.$$
ours=$(awk '/wall/ {print $3}' /tmp/psgd-emulated-ours.$$)
plain=$(awk '/wall/ {print $3}' /tmp/psgd-emulated-plain.$$)
rm -f /tmp/psgd-emulated-ours.$$ /tmp/psgd-emulated-plain.$$
echo "speed-up of PowerSGD over plain allreduce (wall time): $(awk "BEGIN {printf \"%.2f\", $plain / $ours}")x"
