#!/usr/bin/env bash
# The TCP store under a flood (docs/reliability.md, "Rendezvous store: threat
# model"): a 4-rank rendezvous (connect, join counter, publish and read every
# rank's address) timed undisturbed and while CONNECTIONS hostile connections
# (silent, half a frame, wrong token) are held open and reopened as soon as the
# server closes them. Each run prints the median and worst of 5 rendezvous of
# each kind and fails when the flood costs 1 s or more (medians).
#   bench/store_flood.sh [BUILD_DIR (build)] [CONNECTIONS (1000)] [RUNS (5)]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
connections=${2:-1000}
runs=${3:-5}
for _ in $(seq "$runs"); do
  PSGD_LOG_LEVEL=error PSGD_STORE_FLOOD_CONNECTIONS="$connections" \
    "$build/tests/unit/test_store" -tc="tcp store: a 4-rank rendezvous under a flood*" | grep '^store flood:'
done
