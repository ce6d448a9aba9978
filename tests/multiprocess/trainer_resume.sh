#!/bin/sh
# Kill and restart through powersgd-run ends bit-identical: the example trainer
# runs uninterrupted and prints the FNV-1a hash of its final parameters; then,
# with per-rank checkpoints every 5 steps, rank 1 is killed with SIGKILL
# in the middle of saving step 15 (its own files written, the set not complete),
# the job restarts from step 10, rank 1 is killed again at step 23 (mid-epoch,
# after an epoch boundary), the job restarts from step 20 and finishes: the same
# hash. Loopback only, bounded time (--timeout). Skipped (77) without the dataset.
#   trainer_resume.sh POWERSGD_RUN TRAIN_FASHION_MNIST
set -u
run=${1:?usage: trainer_resume.sh POWERSGD_RUN TRAIN_FASHION_MNIST}
trainer=${2:?usage: trainer_resume.sh POWERSGD_RUN TRAIN_FASHION_MNIST}
data=/usr/share/datasets/fashion-mnist
[ -f "$data/train-images-idx3-ubyte.gz" ] || { echo "skipped: needs $data (dataset-fashion-mnist)"; exit 77; }
dir=$(mktemp -d /tmp/psgd-resume-XXXXXX) || exit 1
trap 'rm -rf "$dir"' EXIT
mkdir "$dir/ckpt"
# 1024 samples, global batch 64: 16 steps per epoch, 32 in all; compression from step 4.
args="--data $data --train-limit 1024 --test-limit 1024 --batch 64 --epochs 2 --rank 2 --start-iter 4 --hidden 64"
job() {  # output file, trainer arguments...
  out=$1
  shift
  "$run" -n 2 --timeout 120 -- "$trainer" $args "$@" >"$out" 2>&1
}
hash_of() { sed -n 's/.*parameters fnv1a64 \([0-9a-f]*\) after 32 steps.*/\1/p' "$1"; }
fail() { echo "FAIL: $1"; shift; for f in "$@"; do echo "--- $f"; cat "$f"; done; exit 1; }

job "$dir/uninterrupted" || fail "uninterrupted run" "$dir/uninterrupted"
expected=$(hash_of "$dir/uninterrupted")
[ -n "$expected" ] || fail "no parameter hash" "$dir/uninterrupted"

ck="--checkpoint-dir $dir/ckpt --checkpoint-every 5"
job "$dir/crash1" $ck --crash-at-step 15 --crash-rank 1
code=$?
[ "$code" -ne 0 ] || fail "the run with a crash at step 15 exited 0" "$dir/crash1"
grep -q "rank 1 .*killed by signal 9" "$dir/crash1" || fail "rank 1 was not killed by SIGKILL" "$dir/crash1"
[ -f "$dir/ckpt/step-0000000010/COMPLETE" ] || fail "step 10's set is not complete" "$dir/crash1"
[ ! -e "$dir/ckpt/step-0000000015/COMPLETE" ] || fail "step 15's interrupted set is marked complete" "$dir/crash1"

job "$dir/crash2" $ck --crash-at-step 23 --crash-rank 1
[ $? -ne 0 ] || fail "the run with a crash at step 23 exited 0" "$dir/crash2"
grep -q "resumed from .* at step 10" "$dir/crash2" || fail "did not resume from step 10" "$dir/crash2"
grep -q "rank 1 .*killed by signal 9" "$dir/crash2" || fail "rank 1 was not killed by SIGKILL" "$dir/crash2"

job "$dir/resumed" $ck || fail "resumed run" "$dir/resumed"
grep -q "resumed from .* at step 20" "$dir/resumed" || fail "did not resume from step 20" "$dir/resumed"
got=$(hash_of "$dir/resumed")
[ "$got" = "$expected" ] || fail "parameters differ: uninterrupted $expected, killed twice and resumed $got" \
  "$dir/uninterrupted" "$dir/resumed"
echo "PASS: killed at steps 15 (mid-save) and 23, resumed twice: parameters $got, as uninterrupted"
