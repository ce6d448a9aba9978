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

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Runs the trainer once, prints its output (each line after LABEL) and its wall time, and keeps the wall time in
# $tmp/LABEL.wall; exits the script, naming the run, when the launcher fails or the trainer's last line is missing.
run() {  # label, trainer arguments...
  label=$1
  shift
  start=$(date +%s.%N)
  status=0
  # shellcheck disable=SC2086  # TRAIN_EXTRA: a list of arguments without blanks
  "$RUN" --emulate-hosts "$HOSTS" --link-rate "$RATE" -n "$HOSTS" --timeout 1800 --env PSGD_BLAS_THREADS=1 \
    --env OPENBLAS_NUM_THREADS=1 -- "$TRAIN" --epochs "$EPOCHS" ${TRAIN_EXTRA:-} "$@" > "$tmp/$label.log" 2>&1 ||
    status=$?
  end=$(date +%s.%N)
  sed "s/^/$label /" "$tmp/$label.log"
  if [ "$status" -ne 0 ]; then
    echo "emulated_training.sh: the $label run failed (powersgd-run exited $status): no speed-up" >&2
    exit "$status"
  fi
  # The trainer's final line (rank 0), printed after its last epoch (as bench/training_runs.sh's finished).
  grep -qE '^(\[0\] )?(PowerSGD: .*sent per rank in all|sent .* MB of gradients per rank)' "$tmp/$label.log" || {
    echo "emulated_training.sh: the $label run exited 0 without the trainer's final line" \
      "('PowerSGD: ... sent per rank in all' or 'sent ... MB of gradients per rank'): no speed-up" >&2
    exit 1
  }
  awk "BEGIN {printf \"%.1f\", $end - $start}" > "$tmp/$label.wall"
  echo "$label wall $(cat "$tmp/$label.wall") s"
}
echo "== $HOSTS emulated hosts, links shaped to $RATE, $EPOCHS epoch(s)"
run powersgd --rank 4
run allreduce --no-compression
ours=$(cat "$tmp/powersgd.wall")
plain=$(cat "$tmp/allreduce.wall")
echo "speed-up of PowerSGD over plain allreduce (wall time): $(awk "BEGIN {printf \"%.2f\", $plain / $ours}")x"
