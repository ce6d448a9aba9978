#!/bin/sh
# Bandwidth-bound training, side by side in one run: the example trainer on an
# emulated cluster (N network namespaces, each link shaped to RATE with tbf),
# once with PowerSGD and once with a plain averaged allreduce. Needs root.
# Usage: bench/emulated_training.sh [BUILD_DIR] [HOSTS] [RATE] [EPOCHS]
#   e.g. bench/emulated_training.sh build 4 100mbit 1
set -eu
BUILD=${1:-build}
HOSTS=${2:-4}
RATE=${3:-100mbit}
EPOCHS=${4:-1}
RUN="$BUILD/tools/run/powersgd-run"
TRAIN="$BUILD/examples/train-fashion-mnist"
for f in "$RUN" "$TRAIN"; do
  [ -x "$f" ] || { echo "emulated_training.sh: $f not found (build first: ninja -C $BUILD)" >&2; exit 2; }
done
[ "$(id -u)" -eq 0 ] || { echo "emulated_training.sh: needs root (network namespaces)" >&2; exit 77; }

run() {  # label, trainer arguments...
  label=$1
  shift
  start=$(date +%s.%N)
  "$RUN" --emulate-hosts "$HOSTS" --link-rate "$RATE" -n "$HOSTS" --timeout 1800 --env PSGD_BLAS_THREADS=1 \
    --env OPENBLAS_NUM_THREADS=1 -- "$TRAIN" --epochs "$EPOCHS" "$@" | sed "s/^/$label /"
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
