#!/bin/sh
# The example trainer refuses bad arguments before it joins a job: exit status 2
# and one line naming the value and what was expected (docs/errors.md).
#   trainer_arguments.sh TRAIN_FASHION_MNIST
set -u
train=${1:?usage: trainer_arguments.sh TRAIN_FASHION_MNIST}
fail=0
refused() {  # expected message, trainer arguments...
  expected=$1
  shift
  out=$(env -u WORLD_SIZE -u RANK timeout 20 "$train" "$@" 2>&1)
  status=$?
  if [ "$status" != 2 ] || [ "$out" != "$expected" ]; then
    echo "FAIL $*: status $status (expected 2), output:"
    echo "$out"
    echo "expected: $expected"
    fail=1
  fi
}
for v in -1 0 nan inf -inf; do
  refused "--lr $v: expected a finite learning rate > 0" --lr "$v"
done
refused "--lr-decay-epochs 5: expected an epoch in 1..4 (--epochs)" --epochs 4 --lr-decay-epochs 5
refused "--lr-decay-factor nan: expected a factor in [0, 1]" --lr-decay-factor nan
refused "--outer-lr and --outer-momentum need --local-steps > 1" --outer-lr 0.5
refused "--checkpoint-dir and --checkpoint-every go together" --checkpoint-every 5
# A valid learning rate passes these checks and stops only where the job would start.
out=$(env -u WORLD_SIZE -u RANK -u OMPI_COMM_WORLD_SIZE -u PMI_SIZE -u SLURM_NTASKS timeout 20 "$train" --lr 0.02 2>&1)
case $out in
  *"--lr"*) echo "FAIL --lr 0.02 refused: $out"; fail=1 ;;
  *"no world size"*) ;;
  *) echo "FAIL --lr 0.02: expected the missing world size, got: $out"; fail=1 ;;
esac
[ "$fail" = 0 ] && echo "trainer arguments: every bad value refused"
exit "$fail"
