#!/bin/sh
# Job checkpoint across world sizes: 4 ranks run, save_job and record the next
# steps' outputs; then 2 ranks load_job and must reproduce those outputs
# (test_engine_mp, "job checkpoint: phase 1/2"). Loopback only, bounded time.
#   job_checkpoint.sh POWERSGD_RUN TEST_ENGINE_MP
set -u
run=${1:?usage: job_checkpoint.sh POWERSGD_RUN TEST_ENGINE_MP}
test=${2:?usage: job_checkpoint.sh POWERSGD_RUN TEST_ENGINE_MP}
dir=$(mktemp -d /tmp/psgd-job-XXXXXX) || exit 1
trap 'rm -rf "$dir"' EXIT
export PSGD_JOB_DIR="$dir"
"$run" -n 4 --timeout 120 -- "$test" --no-skip -tc='job checkpoint: phase 1*' || { echo "FAIL: phase 1 (4 ranks)"; exit 1; }
"$run" -n 2 --timeout 120 -- "$test" --no-skip -tc='job checkpoint: phase 2*' || { echo "FAIL: phase 2 (2 ranks)"; exit 1; }
echo "PASS: saved on 4 ranks, resumed on 2"
