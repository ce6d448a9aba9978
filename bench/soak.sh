#!/bin/sh
# Soak: 4 workers, several buckets in flight, 20,000 steps (PSGD_SOAK_STEPS),
# no error, resident memory flat after warm-up (growth under 1%), and the
# error-feedback invariant over the whole run. Each rank prints its figures.
# CI runs the same case with 1,500 steps (meson test engine-soak-n4).
# Usage: bench/soak.sh [BUILD_DIR] [STEPS] [WORKERS]
set -eu
BUILD=${1:-build}
STEPS=${2:-20000}
WORKERS=${3:-4}
RUN="$BUILD/tools/run/powersgd-run"
TEST="$BUILD/tests/multiprocess/test_engine_mp"
for f in "$RUN" "$TEST"; do
  [ -x "$f" ] || { echo "soak.sh: $f not found (build first: ninja -C $BUILD)" >&2; exit 2; }
done
log=$(mktemp)
trap 'rm -f "$log"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
start=$(date +%s)
# The output goes to a file first: through a pipe, dash would report grep's status instead of the launcher's.
status=0
"$RUN" -n "$WORKERS" --timeout 7200 --env PSGD_SOAK_STEPS="$STEPS" -- "$TEST" -tc='soak:*' -s > "$log" 2>&1 ||
  status=$?
grep -E "soak:|test cases|Status|ERROR" "$log" || true
if [ "$status" -ne 0 ]; then
  echo "soak.sh: FAILED: powersgd-run exited $status after $(( $(date +%s) - start )) s; its last lines:" >&2
  tail -n 40 "$log" >&2
  exit "$status"
fi
echo "soak.sh: $STEPS steps on $WORKERS workers in $(( $(date +%s) - start )) s"
