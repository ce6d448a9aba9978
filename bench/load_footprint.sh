#!/usr/bin/env bash
# Resident memory and load time of a CPU-only process using powersgd, against
# the same work linked to OpenBLAS alone (issue 14's goal: within 16 MB and
# 10 ms). bench/load_footprint.c is built once per build directory (linked to
# its libpowersgd.so) and once with OpenBLAS only; each program runs RUNS times
# (default 30) and the medians are printed:
#   to main  spawn to the first instruction of main (exec, dynamic loader,
#            library constructors): the load time
#   wall     spawn to exit
#   VmRSS / VmHWM at the end of main (resident now / at its peak)
# With a CUDA toolkit in CUDA_ROOT (default /usr/local/cuda), one more program
# reproduces the design before the module: the first build's library plus the
# CUDA libraries it used to need (cudart, cuBLAS, cuBLASLt, cuSOLVER) loaded at
# start-up.
#   bench/load_footprint.sh [BUILD_DIR...]       (default: build)
set -euo pipefail
runs=${RUNS:-30}
builds=("$@")
[ ${#builds[@]} -gt 0 ] || builds=(build)
# The build directories are the caller's, relative to its directory: their library directories absolute
# (lib_dirs) before the cd to the source root; the names as given label the rows.
lib_dirs=()
for build in "${builds[@]}"; do
  [ -f "$build/src/libpowersgd.so" ] || {
    echo "load_footprint.sh: $build/src/libpowersgd.so not found (build first: ninja -C $build)" >&2; exit 2; }
  lib_dirs+=("$(cd "$build/src" && pwd)")
done
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# shellcheck disable=SC2046
cc -O2 -std=c99 bench/load_footprint.c -o "$tmp/openblas-only" $(pkg-config --cflags --libs openblas)
programs=("OpenBLAS alone=$tmp/openblas-only")
for i in "${!builds[@]}"; do
  build=${builds[i]} lib_dir=${lib_dirs[i]}
  name=$i-$(basename "$build")
  cc -O2 -std=c99 -DWITH_POWERSGD -Iinclude bench/load_footprint.c -o "$tmp/powersgd-$name" \
    -L"$lib_dir" -lpowersgd -Wl,-rpath,"$lib_dir"
  cuda_needed=$(readelf -d "$lib_dir/libpowersgd.so" | grep -cE 'NEEDED.*\[lib(cu|nv)' || true)
  module=no; [ -f "$lib_dir/libpowersgd-cuda.so" ] && module=yes
  echo "$build: CUDA libraries needed by libpowersgd.so: $cuda_needed; CUDA module built beside it: $module"
  programs+=("powersgd ($build)=$tmp/powersgd-$name")
done
cuda_lib=${CUDA_ROOT:-/usr/local/cuda}/lib64
if [ -f "$cuda_lib/libcublas.so" ]; then
  lib_dir=${lib_dirs[0]}
  cc -O2 -std=c99 -DWITH_POWERSGD -Iinclude bench/load_footprint.c -o "$tmp/powersgd-cuda-linked" \
    -L"$lib_dir" -lpowersgd -Wl,-rpath,"$lib_dir" \
    -Wl,--no-as-needed -L"$cuda_lib" -lcusolver -lcublas -lcublasLt -lcudart -Wl,--as-needed -Wl,-rpath,"$cuda_lib"
  programs+=("powersgd (${builds[0]}) + CUDA libraries linked, as before the module=$tmp/powersgd-cuda-linked")
fi

env -u PSGD_CUDA_MODULE -u LD_LIBRARY_PATH RANK=0 WORLD_SIZE=1 python3 - "$runs" "${programs[@]}" <<'PY'
import statistics, subprocess, sys, time
runs = int(sys.argv[1])
rows = []
for spec in sys.argv[2:]:
    label, path = spec.split("=", 1)
    to_main, wall, rss, hwm = [], [], [], []
    for _ in range(runs):
        spawn = time.time_ns()
        out = subprocess.run([path], capture_output=True, text=True, check=True).stdout
        wall.append((time.time_ns() - spawn) / 1e6)
        fields = dict(item.split("=") for item in out.split())
        to_main.append((int(fields["main_ns"]) - spawn) / 1e6)
        rss.append(int(fields["rss_kb"]) / 1024)
        hwm.append(int(fields["hwm_kb"]) / 1024)
    rows.append((label, statistics.median(to_main), statistics.median(wall), statistics.median(rss),
                 statistics.median(hwm)))
base = rows[0]
print(f"{runs} runs each, medians")
print(f"| program | to main (ms) | wall (ms) | VmRSS (MB) | VmHWM (MB) | VmHWM - OpenBLAS alone (MB) | to main - OpenBLAS alone (ms) |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for label, m, w, r, h in rows:
    print(f"| {label} | {m:.1f} | {w:.1f} | {r:.1f} | {h:.1f} | {h - base[4]:+.1f} | {m - base[1]:+.1f} |")
PY
