#!/usr/bin/env bash
# The main job: installs what is missing, builds, and trains the example model
# on Fashion-MNIST with 4 local workers exchanging PowerSGD-compressed gradients.
#   scripts/demo.sh [extra arguments for the example trainer]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
exec build/tools/run/powersgd-run -n 4 --timeout 900 -- build/examples/train-fashion-mnist "$@"
