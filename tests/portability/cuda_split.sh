#!/bin/sh
# The CUDA backend as a module (docs/compute.md, "The CUDA module"): runs
# cpu_only_probe where the module, the CUDA libraries or a GPU are missing, and
# checks the link structure. One scenario per call:
#   cuda_split.sh SCENARIO PROBE LIBPOWERSGD [MODULE [FAKE_MODULE_ABI FAKE_MODULE_VERSION]]
# Scenarios:
#   linkage        libpowersgd.so needs no CUDA library; the module needs cuBLAS and exports only its entry point
#   no-module      library and probe copied to a fresh directory (a CPU node's deployment): module missing
#   no-cuda-libs   library, module and probe copied; the dynamic loader runs without its cache and without the
#                  module's RUNPATH (the toolkit path a CPU node lacks): CUDA libraries missing
#   no-gpu         the build tree as is: the module loads from beside the library; a GPU is missing (or present)
#   mismatch       PSGD_CUDA_MODULE names modules of another seam ABI, another version, a file that is not a
#                  module, and a file that does not exist
set -eu
scenario=$1 probe=$2 lib=$3 module=${4:-} fake_abi=${5:-} fake_version=${6:-}
export RANK=0 WORLD_SIZE=1
unset PSGD_CUDA_MODULE LD_LIBRARY_PATH LD_PRELOAD 2>/dev/null || true

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fail() { echo "cuda_split.sh $scenario: $*" >&2; exit 1; }
soname() { readelf -d "$1" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p'; }

# A deployment directory: the library under its soname (as the loader asks for it) and the probe.
deploy() {
  cp "$lib" "$tmp/$(soname "$lib")"
  cp "$probe" "$tmp/probe"
}

case $scenario in
linkage)
  needed=$(readelf -d "$lib" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p')
  echo "libpowersgd needs: $(echo $needed)"
  if echo "$needed" | grep -E '^lib(cu|nv)'; then fail "libpowersgd.so needs a CUDA library (above)"; fi
  [ -n "$module" ] || exit 0
  module_needed=$(readelf -d "$module" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p')
  echo "module needs: $(echo $module_needed)"
  echo "$module_needed" | grep -q '^libcublas\.so' || fail "the module does not need libcublas"
  if echo "$module_needed" | grep -q '^libpowersgd'; then fail "the module links libpowersgd (it must stand alone)"; fi
  exported=$(nm -D --defined-only "$module" | awk '{print $NF}')
  echo "module exports: $(echo $exported)"
  [ "$exported" = psgd_cuda_module_v1 ] || fail "the module must export psgd_cuda_module_v1 only"
  ;;
no-module)
  deploy
  LD_LIBRARY_PATH=$tmp "$tmp/probe" "missing the CUDA module" "libpowersgd-cuda.so"
  ;;
no-cuda-libs)
  [ -n "$module" ] || fail "needs the module"
  # Where the dynamic loader looks without its cache and RUNPATHs: the system directories. A toolkit installed
  # there cannot be hidden this way.
  for dir in /lib /usr/lib /lib64 /usr/lib64 /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu \
             /lib/aarch64-linux-gnu /usr/lib/aarch64-linux-gnu; do
    if ls "$dir"/libcublas.so* >/dev/null 2>&1; then
      echo "cuda_split.sh: libcublas is in the system directory $dir: cannot hide it; skipping"
      exit 77
    fi
  done
  deploy
  cp "$module" "$tmp/libpowersgd-cuda.so"
  ldso=$(readelf -l "$probe" | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')
  # --inhibit-cache: no /etc/ld.so.cache (which lists the toolkit here); --inhibit-rpath: the module's RUNPATH
  # to the toolkit is ignored; --library-path: the deployment directory only.
  "$ldso" --inhibit-cache --inhibit-rpath "$tmp/libpowersgd-cuda.so" --library-path "$tmp" \
    "$tmp/probe" "missing the CUDA libraries" "$tmp/libpowersgd-cuda.so" "libcu"
  ;;
no-gpu)
  "$probe" gpu-or-ok
  ;;
mismatch)
  [ -n "$fake_abi" ] && [ -n "$fake_version" ] || fail "needs the fake modules"
  PSGD_CUDA_MODULE=$fake_abi "$probe" "does not belong to this library" "compute seam ABI 1000"
  PSGD_CUDA_MODULE=$fake_version "$probe" "does not belong to this library" "it is powersgd 0.0.0-other"
  PSGD_CUDA_MODULE=$lib "$probe" "does not belong to this library" "no entry point psgd_cuda_module_v1"
  PSGD_CUDA_MODULE=$tmp/nowhere/libpowersgd-cuda.so "$probe" "missing the CUDA module" \
    "PSGD_CUDA_MODULE=$tmp/nowhere/libpowersgd-cuda.so (No such file or directory)"
  ;;
*) fail "unknown scenario" ;;
esac
