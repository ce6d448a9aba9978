#!/usr/bin/env bash
# The GPU check, in two halves (../shared/notes/gpu-device.md: the GPU host has
# the CUDA toolkit but none of our other packages, and can install nothing):
#
#   scripts/gpu-check.sh pack [BUILD_DIR]   on the development machine: a release
#       build with CUDA (default build-gpu), then BUILD_DIR/gpu-bundle.tar.xz
#       with the cuda suite's binaries, the CPU-only probe, powersgd-bench,
#       libpowersgd.so, the CUDA module libpowersgd-cuda.so beside it, and every
#       library they load that is neither CUDA's nor the C/C++ runtime's.
#   scripts/gpu-check.sh run [BUNDLE]       on the GPU host (under 5 minutes):
#       nvidia-smi, unpack to a temporary folder, find the CUDA libraries, check
#       that nothing is missing (ldd), then the cuda suite, the probe (a CUDA
#       reducer must be created), and the engine benchmark on cuda and cpu.
#       Logs and JSON under ${OUT:-gpu-check}/.
#
# Without arguments: pack, then run (a host with a GPU and our packages).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-both}

# The binaries the GPU check runs, relative to the build directory.
binaries=(tests/cuda/test_compute_cuda tests/cuda/test_engine_cuda tests/portability/cpu_only_probe
          tools/bench/powersgd-bench)

pack() {
  local build=$1 stage
  scripts/setup.sh "$build" -Dcuda=enabled -Dbuildtype=release -Dtests=enabled -Dtools=enabled
  stage=$(mktemp -d)
  mkdir -p "$stage/bin" "$stage/lib" "$stage/data"
  for binary in "${binaries[@]}"; do cp "$build/$binary" "$stage/bin/"; done
  # The library under its soname, and the module beside it, where the library looks first.
  local soname
  soname=$(readelf -d "$build/src/libpowersgd.so" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
  cp -L "$build/src/libpowersgd.so" "$stage/lib/$soname"
  cp "$build/src/libpowersgd-cuda.so" "$stage/lib/"
  # Everything else they load, except CUDA's libraries and the C/C++ runtime (newer on the GPU host).
  local name path
  for object in "$stage"/bin/* "$build/src/libpowersgd.so" "$build/src/libpowersgd-cuda.so"; do
    # "name => path (address)" lines; the vDSO and the dynamic loader have no "=>".
    ldd "$object" | awk '$2 == "=>" {print $1, $3}' | while read -r name path; do
      case $name in
        libcu*|libnv*|libc.so*|libm.so*|libstdc++*|libgcc_s*|libdl.so*|libpthread*|librt.so*|libpowersgd*) continue ;;
      esac
      [ -f "$path" ] || { echo "gpu-check: $object needs $name, not found here" >&2; exit 1; }
      [ -f "$stage/lib/$name" ] || cp -L "$path" "$stage/lib/$name"
    done || exit 1  # the pipeline's subshell: its exit leaves only itself
  done
  strip --strip-unneeded "$stage"/bin/* "$stage"/lib/*
  cp data/models/resnet18.shapes "$stage/data/"
  tar -C "$stage" -cJf "$build/gpu-bundle.tar.xz" .
  rm -rf "$stage"
  echo "gpu-check: $build/gpu-bundle.tar.xz ($(du -h "$build/gpu-bundle.tar.xz" | cut -f1)):"
  tar -tJf "$build/gpu-bundle.tar.xz" | grep -v '/$' | sed 's/^/  /'
}

run() {
  local bundle=$1 out=${OUT:-gpu-check} dir cuda_dir
  mkdir -p "$out"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
  dir=$(mktemp -d)
  tar -C "$dir" -xJf "$bundle"
  # The CUDA libraries: the loader's cache, the toolkit, or pip's nvidia packages.
  cuda_dir=$(ldconfig -p | sed -n 's/.*libcublas\.so\.[0-9]* .*=> \(.*\)\/libcublas.*/\1/p' | head -1)
  if [ -z "$cuda_dir" ]; then
    cuda_dir=$(dirname "$(find /usr/local/cuda*/ /usr/lib /opt / -maxdepth 6 -name 'libcublas.so.*' 2>/dev/null |
      head -1)")
  fi
  echo "gpu-check: CUDA libraries from $cuda_dir" | tee "$out/env.txt"
  export LD_LIBRARY_PATH="$dir/lib:$cuda_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  unset PSGD_CUDA_MODULE
  if ldd "$dir"/bin/* "$dir"/lib/*.so* | grep 'not found'; then echo "gpu-check: libraries missing" >&2; exit 1; fi
  local status=0
  for test in test_compute_cuda test_engine_cuda; do
    "$dir/bin/$test" 2>&1 | tee "$out/$test.txt" || status=1
  done
  # The library finds the module beside itself and creates a CUDA reducer.
  RANK=0 WORLD_SIZE=1 "$dir/bin/cpu_only_probe" gpu-or-ok 2>&1 | tee "$out/cpu_only_probe.txt" || status=1
  grep -q "CUDA reducer created" "$out/cpu_only_probe.txt" || { echo "gpu-check: no CUDA reducer" >&2; status=1; }
  for device in cuda cpu; do
    "$dir/bin/powersgd-bench" engine --shapes "$dir/data/resnet18.shapes" --rank 2 --steps 20 \
      --device "$device" --json "$out/engine-$device.json" 2>&1 | tee "$out/engine-$device.txt" || status=1
  done
  rm -rf "$dir"
  return $status
}

case $mode in
  pack) pack "${2:-build-gpu}" ;;
  run) run "${2:-build-gpu/gpu-bundle.tar.xz}" ;;
  # Not "pack && run": bash ignores set -e inside a function called left of &&, so a failed build was packed.
  both) pack build-gpu; run build-gpu/gpu-bundle.tar.xz ;;
  *) echo "usage: scripts/gpu-check.sh [pack [BUILD_DIR] | run [BUNDLE]]" >&2; exit 2 ;;
esac
