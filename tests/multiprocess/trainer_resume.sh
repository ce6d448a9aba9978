#!/bin/sh
# Kill and restart through powersgd-run ends bit-identical: the example trainer
# runs uninterrupted and prints the FNV-1a hash of its final parameters; then,
# with per-rank checkpoints every 5 steps, rank 1 is killed with SIGKILL
# in the middle of saving step 15 (its own files written, the set not complete),
# the job restarts from step 10, rank 1 is killed again at step 23 (mid-epoch,
# after an epoch boundary), the job restarts from step 20 and finishes: the same
# hash. The same again with --local-steps 3 (docs/local-steps.md: the outer
# optimizer's state is in the checkpoint, and the sets at steps 5, 10 and 20 fall
# between outer steps). Loopback only, bounded time (--timeout). Skipped (77)
# without the dataset.
#   trainer_resume.sh POWERSGD_RUN TRAIN_FASHION_MNIST
set -u
run=${1:?usage: trainer_resume.sh POWERSGD_RUN TRAIN_FASHION_MNIST}
trainer=${2:?usage: trainer_resume.sh POWERSGD_RUN TRAIN_FASHION_MNIST}
data=/usr/share/datasets/fashion-mnist
[ -f "$data/train-images-idx3-ubyte.gz" ] || { echo "skipped: needs $data (dataset-fashion-mnist)"; exit 77; }
dir=$(mktemp -d /tmp/psgd-resume-XXXXXX) || exit 1
trap 'rm -rf "$dir"' EXIT
# 1024 samples, global batch 64: 16 steps per epoch, 32 in all; compression from step 4.
args="--data $data --train-limit 1024 --test-limit 1024 --batch 64 --epochs 2 --rank 2 --start-iter 4 --hidden 64"
job() {  # output file, trainer arguments...
  out=$1
  shift
  # shellcheck disable=SC2086  # the argument lists are meant to split
  "$run" -n 2 --timeout 120 -- "$trainer" $args $extra "$@" >"$out" 2>&1
}
hash_of() { sed -n 's/.*parameters fnv1a64 \([0-9a-f]*\) after 32 steps.*/\1/p' "$1"; }
fail() { echo "FAIL: $1"; shift; for f in "$@"; do echo "--- $f"; cat "$f"; done; exit 1; }

scenario() {  # name, extra trainer arguments
  name=$1
  extra=$2
  rm -rf "$dir/ckpt"
  mkdir "$dir/ckpt"
  job "$dir/$name.uninterrupted" || fail "$name: uninterrupted run" "$dir/$name.uninterrupted"
  expected=$(hash_of "$dir/$name.uninterrupted")
  [ -n "$expected" ] || fail "$name: no parameter hash" "$dir/$name.uninterrupted"

  ck="--checkpoint-dir $dir/ckpt --checkpoint-every 5"
  job "$dir/$name.crash1" $ck --crash-at-step 15 --crash-rank 1
  code=$?
  [ "$code" -ne 0 ] || fail "$name: the run with a crash at step 15 exited 0" "$dir/$name.crash1"
  grep -q "rank 1 .*killed by signal 9" "$dir/$name.crash1" || fail "$name: rank 1 was not killed by SIGKILL" "$dir/$name.crash1"
  [ -f "$dir/ckpt/step-0000000010/COMPLETE" ] || fail "$name: step 10's set is not complete" "$dir/$name.crash1"
  [ ! -e "$dir/ckpt/step-0000000015/COMPLETE" ] || fail "$name: step 15's interrupted set is marked complete" "$dir/$name.crash1"

  job "$dir/$name.crash2" $ck --crash-at-step 23 --crash-rank 1
  [ $? -ne 0 ] || fail "$name: the run with a crash at step 23 exited 0" "$dir/$name.crash2"
  grep -q "resumed from .* at step 10" "$dir/$name.crash2" || fail "$name: did not resume from step 10" "$dir/$name.crash2"
  grep -q "rank 1 .*killed by signal 9" "$dir/$name.crash2" || fail "$name: rank 1 was not killed by SIGKILL" "$dir/$name.crash2"

  job "$dir/$name.resumed" $ck || fail "$name: resumed run" "$dir/$name.resumed"
  grep -q "resumed from .* at step 20" "$dir/$name.resumed" || fail "$name: did not resume from step 20" "$dir/$name.resumed"
  # The two newest sets are kept, each whole; the older ones (step 15's interrupted one included) are gone.
  sets=$(ls "$dir/ckpt" | tr '\n' ' ')
  [ "$sets" = "step-0000000025 step-0000000030 " ] || fail "$name: sets left: $sets (expected steps 25 and 30)"
  for set in "$dir"/ckpt/*; do
    [ -f "$set/COMPLETE" ] && [ -f "$set/trainer.rank0" ] && [ -f "$set/trainer.rank1" ] ||
      fail "$name: $set is not whole: $(ls "$set" | tr '\n' ' ')"
  done
  got=$(hash_of "$dir/$name.resumed")
  [ "$got" = "$expected" ] || fail "$name: parameters differ: uninterrupted $expected, killed twice and resumed $got" \
    "$dir/$name.uninterrupted" "$dir/$name.resumed"
  echo "PASS ($name): killed at steps 15 (mid-save) and 23, resumed twice: parameters $got, as uninterrupted"
}

scenario every-step ""
scenario local-steps "--local-steps 3"

# A --checkpoint-dir of each rank's own (each node's disk): each rank removes its own old sets (only rank 0 removed
# sets, so the other nodes kept every one).
mkdir "$dir/own-0" "$dir/own-1"
# shellcheck disable=SC2086,SC2016  # $args splits; $RANK and "$0" are the worker shell's
"$run" -n 2 --timeout 120 --env OWN="$dir/own" -- \
  sh -c 'exec "$0" "$@" --checkpoint-dir "$OWN-$RANK" --checkpoint-every 5' "$trainer" $args >"$dir/own.out" 2>&1 ||
  fail "own directories: the run failed" "$dir/own.out"
for rank in 0 1; do
  sets=$(ls "$dir/own-$rank" | tr '\n' ' ')
  [ "$sets" = "step-0000000025 step-0000000030 " ] ||
    fail "own directories: rank $rank kept $sets (expected steps 25 and 30)" "$dir/own.out"
done
echo "PASS (own directories): each rank kept its two newest sets"
