#!/bin/sh
# The example trainer's CNN, 2 ranks under powersgd-run on loopback: a few steps
# of training lower the training loss, with PowerSGD (rank 2, error feedback,
# warm start) and with both switched off; each epoch reports the bytes sent.
# Exit 77 without the Fashion-MNIST data set.
#   trainer_cnn.sh POWERSGD_RUN TRAIN_FASHION_MNIST
set -u
run=${1:?usage: trainer_cnn.sh POWERSGD_RUN TRAIN_FASHION_MNIST}
train=${2:?usage: trainer_cnn.sh POWERSGD_RUN TRAIN_FASHION_MNIST}
data=/usr/share/datasets/fashion-mnist
[ -f "$data/train-images-idx3-ubyte.gz" ] || { echo "skipped: no Fashion-MNIST in $data"; exit 77; }
out=$(mktemp)
trap 'rm -f "$out"' EXIT

fail=0
check() {  # label, trainer arguments...
  label=$1
  shift
  # 3 epochs of 8 steps (512 images, global batch 64), the first 4 steps plain allreduce.
  if ! timeout 150 "$run" -n 2 --timeout 120 --env OPENBLAS_NUM_THREADS=1 -- "$train" --model cnn --epochs 3 \
      --train-limit 512 --test-limit 200 --batch 64 --lr 0.02 --start-iter 4 "$@" >"$out" 2>&1; then
    echo "FAIL $label: the run failed:"; cat "$out"; fail=1; return
  fi
  losses=$(sed -n 's/^\[0\] epoch [0-9]*: train loss \([0-9.]*\),.*/\1/p' "$out")
  first=$(echo "$losses" | head -n 1)
  last=$(echo "$losses" | tail -n 1)
  epochs=$(echo "$losses" | grep -c .)
  bytes=$(grep -c "bytes sent per rank" "$out")
  if [ "$epochs" -ne 3 ] || [ "$bytes" -ne 3 ]; then
    echo "FAIL $label: expected 3 epoch lines with bytes sent, got:"; cat "$out"; fail=1; return
  fi
  if awk "BEGIN {exit !($last < 0.9 * $first)}"; then
    echo "ok $label: train loss $first -> $last"
  else
    echo "FAIL $label: train loss $first -> $last, expected a drop of more than 10%:"; cat "$out"; fail=1
  fi
}
check "rank 2" --rank 2
check "rank 2, no error feedback, no warm start" --rank 2 --no-error-feedback --no-warm-start
exit $fail
