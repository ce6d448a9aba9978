#!/bin/sh
# Time to accuracy on an emulated cluster: the example trainer on HOSTS network
# namespaces (powersgd-run --emulate-hosts), every host's link shaped to RATE with
# DELAY one way, once per row and rate (rows named as in bench/paper_table.sh:
# allreduce, rankR, localH, localH-rankR, localH-rankR-no-ef, ...), then
# bench/time_to_accuracy.py: each row's wall time to the allreduce row's final
# test accuracy at that rate (OUT_DIR/time_to_accuracy.md). Needs root.
#
# Usage: bench/time_to_accuracy.sh BUILD_DIR
# Environment (defaults):
#   OUT_DIR (/tmp/powersgd-time-to-accuracy), HOSTS (4), RATES ("1gbit 100mbit"), DELAY (5ms),
#   ROWS ("allreduce rank2 local4-rank4 local16-rank4 local16-rank2"), MODEL (wide), EPOCHS (16), SEED (1),
#   TRAIN_LIMIT (7680), BATCH (256), LR (0.02), TEST_LIMIT (0: all 10,000 test images),
#   OUTER_LR and OUTER_MOMENTUM (as bench/paper_table.sh).
# The schedule is paper_table.sh's: the learning rate times 0.1 from 60% and from 80% of the epochs.
# Runs whose log holds a finished run of the same command line (the log's first line) are kept (SKIP_DONE=0
# reruns them); a finished log of another command is run again.
set -eu
BUILD=${1:?usage: bench/time_to_accuracy.sh BUILD_DIR}
OUT_DIR=${OUT_DIR:-/tmp/powersgd-time-to-accuracy}
HOSTS=${HOSTS:-4}
RATES=${RATES:-1gbit 100mbit}
DELAY=${DELAY:-5ms}
ROWS=${ROWS:-allreduce rank2 local4-rank4 local16-rank4 local16-rank2}
MODEL=${MODEL:-wide}
EPOCHS=${EPOCHS:-16}
SEED=${SEED:-1}
TRAIN_LIMIT=${TRAIN_LIMIT:-7680}
BATCH=${BATCH:-256}
LR=${LR:-0.02}
TEST_LIMIT=${TEST_LIMIT:-0}
SKIP_DONE=${SKIP_DONE:-1}
HERE=$(dirname "$0")
# shellcheck source=bench/emulated_preamble.sh
. "$HERE/emulated_preamble.sh"
emulated_preamble time_to_accuracy.sh train
# shellcheck source=bench/training_runs.sh
. "$HERE/training_runs.sh"

steps=$(((TRAIN_LIMIT > 0 ? TRAIN_LIMIT : 60000) / BATCH))  # per epoch (0: all 60,000 images)
warmup=$steps boost=$((steps / 2)) interval=$(((steps + 2) / 3))  # read by row_args (policy rows)
decay=$(decay_args "$EPOCHS")
common="--model $MODEL --epochs $EPOCHS --batch $BATCH --lr $LR $decay --train-limit $TRAIN_LIMIT"
common="$common --test-limit $TEST_LIMIT --start-iter 0 --seed $SEED"

failed=""
for rate in $RATES; do
  dir="$OUT_DIR/$rate"
  mkdir -p "$dir"
  echo "== $MODEL on $HOSTS emulated hosts, $rate, $DELAY one way: $EPOCHS epochs of $steps steps, seed $SEED"
  for row in $ROWS; do
    log="$dir/$row.log"
    args=$(row_args "$row")
    cmd="$RUN --emulate-hosts $HOSTS -n $HOSTS --link-rate $rate --link-delay $DELAY --timeout 3600"
    cmd="$cmd --env OPENBLAS_NUM_THREADS=1 --env PSGD_BLAS_THREADS=1 -- $TRAIN $common $args"
    if [ "$SKIP_DONE" = 1 ] && finished "$log" "$cmd"; then
      echo "   $rate $row: kept $log"
      continue
    fi
    [ "$SKIP_DONE" = 1 ] && finished "$log" && echo "   $rate $row: $log is of another command: run again"
    run_logged "$log" "$cmd" || failed="$failed $rate/$row"
  done
done
/usr/bin/python3 "$HERE/time_to_accuracy.py" "$OUT_DIR"
[ -z "$failed" ] || { echo "time_to_accuracy.sh: failed:$failed" >&2; exit 1; }
