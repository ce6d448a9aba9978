#!/usr/bin/env bash
# The GPU check, for a host with an NVIDIA GPU (fits in 5 minutes): builds with
# CUDA, runs the cuda suite (compute backend and engine on the GPU against the
# CPU and the double-precision reference), then the engine benchmark on the GPU
# and the CPU side by side. Output (and JSON) under ${OUT:-gpu-check}/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check}
mkdir -p "$out"
export PATH="/usr/local/cuda/bin:$PATH"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
scripts/setup.sh build-gpu -Dcuda=enabled -Dbuildtype=release -Dtests=enabled >"$out/build.log" 2>&1 ||
  { tail -40 "$out/build.log"; exit 1; }
meson test -C build-gpu --suite cuda --print-errorlogs 2>&1 | tee "$out/tests.txt"
for device in cuda cpu; do
  build-gpu/tools/bench/powersgd-bench engine --shapes data/models/resnet18.shapes --rank 2 --steps 20 \
    --device "$device" --json "$out/engine-$device.json" 2>&1 | tee "$out/engine-$device.txt"
done
