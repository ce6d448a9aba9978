#!/usr/bin/env bash
# Builds and runs every test suite: a warnings-as-errors build runs all suites
# (unit, multiprocess, cuda: CUDA tests skip without a GPU), then an
# address+undefined sanitizer build (with libstdc++'s _GLIBCXX_ASSERTIONS) runs the unit suite and a thread sanitizer
# build runs the tsan suite (the store, communicator, shared-memory link, threads of the compute and engine; these
# two build only what their tests need), and each libFuzzer
# target runs
# for 60 s in a clang build (scripts/fuzz.sh; one result per target). Ends with
# "N passed, N failed, N skipped".
#   scripts/test.sh [--quick]   (--quick: the first build only)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
quick=0
[ "${1:-}" = "--quick" ] && quick=1

logs=()
status=0
# name, "full" (build everything, then test) or "needed" (meson test builds what its tests need), meson test
# args, meson setup args...
run_build() {
  local dir=$1 extent=$2 test_args=$3
  shift 3
  local setup_args=("$dir" "$@")
  [ "$extent" = full ] || setup_args=(--configure-only "${setup_args[@]}")
  if ! scripts/setup.sh "${setup_args[@]}"; then
    echo "test: build $dir failed"
    logs+=("BUILD_FAILED:$dir")
    status=1
    return
  fi
  rm -f "$dir/meson-logs/testlog.json"
  local runner=0
  # shellcheck disable=SC2086
  meson test -C "$dir" --print-errorlogs --num-processes 1 $test_args || runner=$?
  [ $runner -eq 0 ] || status=1
  if [ -f "$dir/meson-logs/testlog.json" ]; then
    logs+=("$dir/meson-logs/testlog.json")
    # Counted as a failure where the log records none (a runner interrupted or killed half-way).
    [ $runner -eq 0 ] || logs+=("RUNNER_FAILED:$dir")
  else
    echo "test: building the tests of $dir failed"
    logs+=("BUILD_FAILED:$dir")
  fi
}

run_build build full "" -Dwerror=true -Dbuildtype=debugoptimized
if [ $quick -eq 0 ]; then
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
  # _GLIBCXX_ASSERTIONS: libstdc++'s checks (an empty optional dereferenced, an index out of range) abort,
  # as under Fedora's and RHEL's default hardening, where the sanitizers alone may read on silently.
  # -O1: with both sanitizers test_engine.cpp compiles in 82 s against 131 s at -O2 (what costs most in this
  # build); -O0 (23 s) ran the compute test past its timeout and exported inline operators of the public
  # headers out of line (abi-exports).
  run_build build-asan needed "--suite unit" -Dwerror=true -Doptimization=1 -Db_sanitize=address,undefined \
    -Db_lundef=false -Dcuda=disabled -Dcpp_args=-D_GLIBCXX_ASSERTIONS
  export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
  run_build build-tsan needed "--suite tsan" -Dwerror=true -Db_sanitize=thread -Dcuda=disabled
  if command -v clang++ >/dev/null 2>&1; then
    rm -f build-fuzz/fuzz-results.tsv
    scripts/fuzz.sh --seconds 60 || status=1
    if [ -f build-fuzz/fuzz-results.tsv ]; then logs+=("build-fuzz/fuzz-results.tsv"); else logs+=("BUILD_FAILED:build-fuzz"); fi
  fi
fi

python3 scripts/summarize_tests.py "${logs[@]}" || status=1
exit $status
