#!/bin/sh
# powersgd-halve (tools/halve) end to end on a tiny job: 2 workers, one epoch of
# 256 images; with a tolerance of 100 points every rank is accepted, so it runs
# the allreduce baseline and ranks 2 and 1, and writes the curve as JSON.
# Exit 77 without the Fashion-MNIST data set.
#   halve_smoke.sh POWERSGD_HALVE BUILD_DIR
set -u
halve=${1:?usage: halve_smoke.sh POWERSGD_HALVE BUILD_DIR}
build=${2:?usage: halve_smoke.sh POWERSGD_HALVE BUILD_DIR}
data=/usr/share/datasets/fashion-mnist
[ -f "$data/train-images-idx3-ubyte.gz" ] || { echo "skipped: no Fashion-MNIST in $data"; exit 77; }
json=$(mktemp)
trap 'rm -f "$json"' EXIT

if ! OPENBLAS_NUM_THREADS=1 python3 "$halve" --build "$build" --workers 2 --epochs 1 --start-rank 2 --tolerance 100 \
    --timeout 120 --json "$json" -- --train-limit 256 --test-limit 100 --batch 64 --start-iter 1; then
  echo "FAIL: powersgd-halve exited with status $? (expected 0: every rank within a tolerance of 100 points)"
  exit 1
fi
python3 - "$json" <<'PY' || exit 1
import json, sys
result = json.load(open(sys.argv[1]))
ranks = [row["rank"] for row in result["curve"]]
assert ranks == [2, 1], f"curve ranks {ranks}, expected [2, 1]"
for row in [result["allreduce"]] + result["curve"]:
    assert 0 <= row["accuracy"] <= 100, row
    assert row["mb_sent_per_worker"] is not None and row["mb_sent_per_worker"] > 0, row
plain = result["allreduce"]["mb_sent_per_worker"]
assert all(row["mb_sent_per_worker"] < plain for row in result["curve"]), result
print("powersgd-halve: curve", ranks, "payload", plain, "MB plain,", [row["mb_sent_per_worker"] for row in result["curve"]])
PY
