#!/bin/sh
# The PowerSGD paper's table on this machine: the example trainer on
# Fashion-MNIST, WORKERS workers through powersgd-run on loopback, every row
# once per seed, with a learning-rate schedule that decays twice. Models (MODELS):
# `wide` (784-1024-1024-10 perceptron, the paper's regime: rank 2 sends 157x
# fewer elements per step than a plain allreduce) and `cnn` (the small CNN, 25x
# at rank 2). Rows (ROWS): plain allreduce; rank 1, 2, 4, 8 with error feedback;
# rank 2 without error feedback; rank 2 without warm start; the norm-change rule
# (adaptive); the schedule-aware policy (warm-up and learning-rate notes, with a
# fixed low rank and with the norm-change rule; the same from rank 4, and its
# warm-up alone); alternating; rank 2 with bf16 factors on the wire. Local steps
# (docs/local-steps.md), not in the default rows: localH (H local steps per outer
# step, the outer step a plain averaged allreduce), localH-rankR (PowerSGD rank R
# with error feedback on the pseudo-gradients), localH-rankR-no-ef (without it),
# any H and R, e.g. ROWS="allreduce rank2 local16 local16-rank2 local16-rank2-no-ef"; their outer
# optimizer from OUTER_LR and OUTER_MOMENTUM (unset: the trainer's defaults, 1 and 0: plain averaging). Writes
# OUT_DIR/<model>/<row>-s<seed>.log (first line: the command that made it), then
# bench/paper_table.py makes OUT_DIR/table.md, OUT_DIR/table.json and the figures
# (mean and standard error over the seeds of the final test accuracy, bytes per
# rank).
#
# Usage: bench/paper_table.sh BUILD_DIR
# Environment (defaults):
#   OUT_DIR (/tmp/powersgd-paper-table), MODELS ("wide cnn"), WORKERS (16), SEEDS ("1 2 3"),
#   ROWS (all: "allreduce rank1 rank2 rank4 rank8 rank2-no-ef rank2-no-warm-start adaptive policy
#         policy-adaptive alternating rank2-bf16 policy-4-8 policy-adaptive-4-8 policy-warmup-4-8";
#         policy rows need the trainer's --warmup-steps/--lr-notes,
#         rank2-bf16 its --wire-dtype),
#   EPOCHS (wide 4, cnn 4), TRAIN_LIMIT (wide 7680, cnn 3840 training images: a subset, to fit 2 cores),
#   TEST_LIMIT (0: all 10,000 test images), BATCH (wide 256, cnn 128), LR (0.02),
#   START_ITER (0: compressed from the first step, so the bytes show the compression itself),
#   POLICY_LOW (2), POLICY_HIGH (8), WARMUP_STEPS (one epoch's steps), LR_BOOST_STEPS (half an epoch's steps),
#   ADAPTIVE_INTERVAL (a third of an epoch's steps).
# Rows whose log already holds a finished run of the same command line (the log's first line) are kept (delete
# the log to rerun it; SKIP_DONE=0 reruns all); a finished log of another command is run again.
set -eu
BUILD=${1:?usage: bench/paper_table.sh BUILD_DIR}
OUT_DIR=${OUT_DIR:-/tmp/powersgd-paper-table}
MODELS=${MODELS:-wide cnn}
WORKERS=${WORKERS:-16}
SEEDS=${SEEDS:-1 2 3}
# shellcheck source=bench/training_runs.sh
. "$(dirname "$0")/training_runs.sh"  # row_args, decay_args, finished, run_logged, ALL_ROWS, POLICY_LOW, POLICY_HIGH
ROWS=${ROWS:-$ALL_ROWS}
TEST_LIMIT=${TEST_LIMIT:-0}
START_ITER=${START_ITER:-0}
SKIP_DONE=${SKIP_DONE:-1}
RUN="$BUILD/tools/run/powersgd-run"
TRAIN="$BUILD/examples/train-fashion-mnist"
HERE=$(dirname "$0")
for f in "$RUN" "$TRAIN"; do
  [ -x "$f" ] || { echo "paper_table.sh: $f not found (build first: ninja -C $BUILD)" >&2; exit 2; }
done

failed=""
for model in $MODELS; do
  case $model in
    wide) epochs=${EPOCHS:-4} train_limit=${TRAIN_LIMIT:-7680} batch=${BATCH:-256} lr=${LR:-0.02} ;;
    cnn) epochs=${EPOCHS:-4} train_limit=${TRAIN_LIMIT:-3840} batch=${BATCH:-128} lr=${LR:-0.02} ;;
    *) echo "paper_table.sh: unknown model '$model' in MODELS (expected wide, cnn)" >&2; exit 2 ;;
  esac
  steps=$(((train_limit > 0 ? train_limit : 60000) / batch))  # per epoch (0: all 60,000 images)
  warmup=${WARMUP_STEPS:-$steps}
  boost=${LR_BOOST_STEPS:-$((steps / 2))}
  interval=${ADAPTIVE_INTERVAL:-$(((steps + 2) / 3))}
  decay=$(decay_args "$epochs")
  common="--model $model --epochs $epochs --batch $batch --lr $lr $decay --train-limit $train_limit"
  common="$common --test-limit $TEST_LIMIT --start-iter $START_ITER"
  dir="$OUT_DIR/$model"
  mkdir -p "$dir"
  echo "== $model: $WORKERS workers, $epochs epochs of $steps steps, $train_limit training images, seeds $SEEDS;" \
    "load: $(cut -d' ' -f1-3 /proc/loadavg)"
  for row in $ROWS; do
    args=$(row_args "$row")
    for seed in $SEEDS; do
      log="$dir/$row-s$seed.log"
      extra=""
      case $row in policy*) extra="--decision-log $dir/$row-s$seed.decisions.jsonl" ;; esac
      cmd="$RUN -n $WORKERS --timeout 3600 --env OPENBLAS_NUM_THREADS=1 --env PSGD_BLAS_THREADS=1 -- $TRAIN"
      cmd="$cmd $common $args --seed $seed $extra"
      if [ "$SKIP_DONE" = 1 ] && finished "$log" "$cmd"; then
        echo "   $model $row seed $seed: kept $log"
        continue
      fi
      [ "$SKIP_DONE" = 1 ] && finished "$log" && echo "   $model $row seed $seed: $log is of another command: run again"
      run_logged "$log" "$cmd" || failed="$failed $model/$row/s$seed"
    done
  done
done
/usr/bin/python3 "$HERE/paper_table.py" "$OUT_DIR"
[ -z "$failed" ] || { echo "paper_table.sh: runs that failed:$failed (left out of the table)"; exit 1; }
