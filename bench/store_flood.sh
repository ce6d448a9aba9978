#!/usr/bin/env bash
# The TCP store under a flood (docs/reliability.md, "Rendezvous store: threat
# model"): a 4-rank rendezvous (connect, join counter, publish and read every
# rank's address) timed undisturbed and while CONNECTIONS hostile connections
# (silent, half a frame, wrong token) are held open and reopened as soon as the
# server closes them. Each run prints the median and worst of 5 rendezvous of
# each kind and fails when the flood costs 1 s or more (medians).
#   bench/store_flood.sh [BUILD_DIR (build)] [CONNECTIONS (1000)] [RUNS (5)]
set -euo pipefail
build=${1:-build}
# BUILD_DIR is the caller's, relative to its directory: absolute before the cd to the source root.
[ -d "$build" ] || { echo "store_flood.sh: $build: no build directory" >&2; exit 2; }
build=$(cd "$build" && pwd)
[ -x "$build/tests/unit/test_store" ] || {
  echo "store_flood.sh: $build/tests/unit/test_store not found (build first: ninja -C $build)" >&2; exit 2; }
cd "$(dirname "$0")/.."
connections=${2:-1000}
runs=${3:-5}
for _ in $(seq "$runs"); do
  PSGD_LOG_LEVEL=error PSGD_STORE_FLOOD_CONNECTIONS="$connections" \
    "$build/tests/unit/test_store" -tc="tcp store: a 4-rank rendezvous under a flood*" | grep '^store flood:'
done
