#!/bin/sh
# The example trainer's CNN, 2 ranks under powersgd-run on loopback: a few steps
# of training lower the training loss, with PowerSGD (rank 2, error feedback,
# warm start) and with both switched off; each epoch reports the bytes sent.
# Then the wide perceptron: its compression printed at start, --seed
# changing where training ends, and --submit all and each ending alike.
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
hash_in() { sed -n 's/^\[0\] parameters fnv1a64 \([0-9a-f]*\) .*/\1/p' "$1"; }  # rank 0's final parameters
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

# --model wide (784-1024-1024-10, the paper's regime) prints its compression by the
# engine's rule at start; --seed changes the initialization and the data order.
hashes=""
for seed in 1 2; do
  if ! timeout 150 "$run" -n 2 --timeout 120 --env OPENBLAS_NUM_THREADS=1 -- "$train" --model wide --epochs 1 \
      --train-limit 64 --test-limit 50 --batch 32 --rank 2 --start-iter 0 --seed $seed >"$out" 2>&1; then
    echo "FAIL wide, seed $seed: the run failed:"; cat "$out"; fail=1; continue
  fi
  if ! grep -q "^\[0\] compression by the engine's rule: plain allreduce 7454760 bytes per step; rank 2 47352 bytes per compressed step (157.4x)" "$out"; then
    echo "FAIL wide, seed $seed: expected its compression at start (157.4x at rank 2):"; cat "$out"; fail=1
  fi
  hashes="$hashes $(hash_in "$out")"
done
set -- $hashes
if [ $# -eq 2 ] && [ "$1" != "$2" ]; then
  echo "ok wide: 157.4x at rank 2, seeds 1 and 2 end at parameters $1 and $2"
else
  echo "FAIL wide: expected two different parameter hashes for seeds 1 and 2, got:$hashes"; fail=1
fi

# --submit all (the default: Reducer::reduce_all, both buckets in one reduction) and --submit each
# (Reducer::reduce per bucket) end at the same parameters, bit for bit, on 3 ranks (where the order of a
# sum matters), plain steps included; the fused step pays 2 communication rounds, bucket by bucket twice that.
hashes="" rounds=""
for submit in all each; do
  # The rounds are the defaults': no inherited setting that changes them (docs/env.md, docs/engine.md).
  if ! env -u PSGD_CARRY_FIRST -u PSGD_DIRECT_MAX_BYTES -u PSGD_DIRECT_EAGER -u PSGD_SCATTER_GATHER \
      -u PSGD_FUSE_REDUCTIONS -u PSGD_HOST_STAGE -u PSGD_RING_THRESHOLD_BYTES \
      timeout 150 "$run" -n 3 --timeout 120 --env OPENBLAS_NUM_THREADS=1 -- "$train" --model wide --epochs 2 \
      --train-limit 384 --test-limit 50 --batch 48 --rank 2 --start-iter 2 --submit $submit >"$out" 2>&1; then
    echo "FAIL submit $submit: the run failed:"; cat "$out"; fail=1; continue
  fi
  hashes="$hashes $(hash_in "$out")"
  rounds="$rounds $(sed -n 's/^\[0\] epoch 2: .*, \([0-9.]*\) communication rounds per step$/\1/p' "$out")"
done
set -- $hashes
if [ $# -eq 2 ] && [ "$1" = "$2" ] && [ "$rounds" = " 2.0 4.0" ]; then
  echo "ok submit: all and each end at parameters $1, 2.0 and 4.0 rounds per step"
else
  echo "FAIL submit: expected one parameter hash for all and each and rounds 2.0 4.0, got:$hashes;$rounds"; fail=1
fi
exit $fail
