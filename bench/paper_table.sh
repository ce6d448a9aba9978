#!/bin/sh
# The PowerSGD paper's table on this machine: the example trainer's CNN on
# Fashion-MNIST, WORKERS workers through powersgd-run on loopback, one run per
# row (plain allreduce; rank 1, 2, 4 with error feedback; rank 2 without error
# feedback; rank 2 without warm start; adaptive rank; alternating), with a
# learning-rate decay. Writes OUT_DIR/table.md, OUT_DIR/table.json,
# OUT_DIR/paper_table.png (test accuracy vs epoch and vs bytes sent) and one
# log per row (first line: the command that made it); prints every command.
#
# Usage: bench/paper_table.sh BUILD_DIR [EPOCHS]     (default EPOCHS 5)
# Environment (defaults): OUT_DIR (/tmp/powersgd-paper-table), WORKERS (4),
#   TRAIN_LIMIT (10240 training images: a subset, to keep the table short; the 8
#   rows took 35 minutes on 2 cores at a load average of about 20), TEST_LIMIT
#   (5000 test images),
#   ROWS (all rows: "allreduce rank1 rank2 rank4 rank2-no-ef rank2-no-warm-start adaptive adaptive24
#   alternating alternating4"; a subset reruns those rows and keeps the other logs
#   found in OUT_DIR in the table: each log's first line says how it was made).
set -eu
BUILD=${1:?usage: bench/paper_table.sh BUILD_DIR [EPOCHS]}
EPOCHS=${2:-5}
OUT_DIR=${OUT_DIR:-/tmp/powersgd-paper-table}
WORKERS=${WORKERS:-4}
TRAIN_LIMIT=${TRAIN_LIMIT:-10240}
TEST_LIMIT=${TEST_LIMIT:-5000}
ROWS=${ROWS:-allreduce rank1 rank2 rank4 rank2-no-ef rank2-no-warm-start adaptive adaptive24 alternating alternating4}
RUN="$BUILD/tools/run/powersgd-run"
TRAIN="$BUILD/examples/train-fashion-mnist"
HERE=$(dirname "$0")
for f in "$RUN" "$TRAIN"; do
  [ -x "$f" ] || { echo "paper_table.sh: $f not found (build first: ninja -C $BUILD)" >&2; exit 2; }
done
case $EPOCHS in '' | *[!0-9]*) echo "paper_table.sh: EPOCHS '$EPOCHS': expected a whole number >= 1" >&2; exit 2 ;; esac
[ "$EPOCHS" -ge 1 ] || { echo "paper_table.sh: EPOCHS $EPOCHS: expected >= 1" >&2; exit 2; }
mkdir -p "$OUT_DIR"

# Learning rate 0.02, times 0.1 from 60% and again from 80% of the epochs
# (epochs 4 and 5 of 5): the decays the paper's schedule has, scaled down.
decay1=$((EPOCHS * 6 / 10 + 1))
decay2=$((EPOCHS * 8 / 10 + 1))
[ "$decay2" -gt "$decay1" ] || decay2=$((decay1 + 1))
decay="--lr-decay-factor 1"
if [ "$decay1" -le "$EPOCHS" ]; then
  decay="--lr-decay-epochs $decay1 --lr-decay-factor 0.1"
  [ "$decay2" -le "$EPOCHS" ] && decay="--lr-decay-epochs $decay1,$decay2 --lr-decay-factor 0.1"
fi
common="--model cnn --epochs $EPOCHS --batch 128 --lr 0.02 $decay --train-limit $TRAIN_LIMIT --test-limit $TEST_LIMIT --start-iter 10"

row_args() {
  case $1 in
    allreduce) echo "--no-compression" ;;
    rank1) echo "--rank 1" ;;
    rank2) echo "--rank 2" ;;
    rank4) echo "--rank 4" ;;
    rank2-no-ef) echo "--rank 2 --no-error-feedback" ;;
    rank2-no-warm-start) echo "--rank 2 --no-warm-start" ;;
    adaptive) echo "--adaptive --rank-low 1 --rank-high 4 --adaptive-interval 20" ;;
    adaptive24) echo "--adaptive --rank-low 2 --rank-high 4 --adaptive-interval 20" ;;
    alternating) echo "--rank 2 --alternating" ;;
    alternating4) echo "--rank 4 --alternating" ;;
    *) echo "paper_table.sh: unknown row '$1' in ROWS" >&2; return 2 ;;
  esac
}

echo "== $WORKERS workers, CNN, $EPOCHS epochs, $TRAIN_LIMIT training images, $TEST_LIMIT test images; load: $(cut -d' ' -f1-3 /proc/loadavg)"
failed=""
for row in $ROWS; do
  args=$(row_args "$row")
  cmd="$RUN -n $WORKERS --timeout 3600 --env OPENBLAS_NUM_THREADS=1 --env PSGD_BLAS_THREADS=1 -- $TRAIN $common $args"
  echo "\$ $cmd"
  log="$OUT_DIR/$row.log"
  {
    echo "\$ $cmd"
    echo "# load before: $(cut -d' ' -f1-3 /proc/loadavg)"
  } > "$log"
  # shellcheck disable=SC2086  # the argument lists are meant to split
  if $cmd >> "$log" 2>&1; then
    grep -E "^\[0\] (epoch|PowerSGD|sent)" "$log" | tail -n 2
  else
    echo "   $row: failed (status $?), see $log"
    failed="$failed $row"
  fi
  echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$log"
done
/usr/bin/python3 "$HERE/paper_table.py" "$OUT_DIR"
[ -z "$failed" ] || { echo "paper_table.sh: rows that failed:$failed (left out of the table)"; exit 1; }
