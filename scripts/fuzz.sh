#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) in a clang build directory with
# ASan and UBSan, and runs each for a fixed time from its seed corpus
# (tests/fuzz/corpus/<target>/). Fails (exit 1) on any finding: a crash, a
# sanitizer report, a leak, a timeout (-timeout, seconds per input) or memory
# above -rss_limit_mb. Prints executions and coverage per target, and writes
# them as TSV to BUILD_DIR/fuzz-results.tsv (target, result, executions, cov, ft,
# seconds) for scripts/summarize_tests.py. Findings are saved under
# BUILD_DIR/fuzz-findings/<target>/.
#   scripts/fuzz.sh [--seconds N] [--build-dir DIR] [TARGET...]
# Default: 60 s per target, build-fuzz, every target. Long run: --seconds 600.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

seconds=60
build_dir=build-fuzz
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=${2:?--seconds needs a number}; shift 2 ;;
    --build-dir) build_dir=${2:?--build-dir needs a directory}; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option '$1'" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
case "$seconds" in ''|*[!0-9]*|0) echo "fuzz.sh: --seconds '$seconds': expected a positive integer" >&2; exit 2 ;; esac
all_targets=(fuzz_store_frames fuzz_store_session fuzz_checkpoint fuzz_launcher_options)
[ ${#targets[@]} -gt 0 ] || targets=("${all_targets[@]}")

# clang and libFuzzer's runtime, from Debian (idempotent).
if ! command -v clang++ >/dev/null 2>&1 || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
  echo "fuzz.sh: installing clang libclang-rt-14-dev"
  sudo_cmd=(env DEBIAN_FRONTEND=noninteractive)  # inside sudo, which resets the environment
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo env DEBIAN_FRONTEND=noninteractive)
  { "${sudo_cmd[@]}" apt-get update -qq &&  # a fresh machine's package lists are empty
      "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends clang libclang-rt-14-dev; } \
    || { echo "fuzz.sh: cannot install clang" >&2; exit 1; }
fi

# Warnings are not errors here: clang warns about Debian's OpenBLAS header
# (_Complex in C++), which the gcc build (-Dwerror=true) does not see.
if [ ! -f "$build_dir/build.ninja" ]; then
  CC=clang CXX=clang++ meson setup "$build_dir" -Dfuzz=enabled -Dcuda=disabled -Dibverbs=disabled \
    -Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debugoptimized \
    || { echo "fuzz.sh: meson setup failed" >&2; exit 1; }
fi
ninja -C "$build_dir" "${targets[@]/#/tests/fuzz/}" || { echo "fuzz.sh: build failed" >&2; exit 1; }

results="$build_dir/fuzz-results.tsv"
: >"$results"
failed=0
# The caller's options first, ours after them (the later wins): a report always fails the target.
export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=${UBSAN_OPTIONS:+$UBSAN_OPTIONS:}halt_on_error=1:print_stacktrace=1
# A target's network namespace goes on any exit (a terminated run left it in /run/netns).
ns=""
trap '[ -z "$ns" ] || ip netns delete "$ns" 2>/dev/null' EXIT
trap 'exit 143' TERM
trap 'exit 129' HUP
for t in "${targets[@]}"; do
  seeds="tests/fuzz/corpus/$t"
  work="$build_dir/fuzz-corpus/$t"      # grows across runs; the seeds stay as committed
  findings="$build_dir/fuzz-findings/$t"
  log="$build_dir/fuzz-$t.log"
  mkdir -p "$work" "$findings"
  stamp="$findings/.run-start"  # findings of earlier runs are kept but not counted again
  : >"$stamp"
  start=$(date +%s)
  # The session target opens a loopback connection per input (about 1,000 a
  # second on a quiet machine). As root it runs in a network namespace of its
  # own whose TIME_WAIT table is capped (the kernel drops the excess), so a long
  # run cannot exhaust the host's ephemeral ports. (Two CI runs that failed with
  # "connect to the store server" after about 26,000 inputs were the harness's
  # connect interrupted by libFuzzer's timer signal, EINTR, handled since.)
  runner=()
  ns=""
  if [ "$t" = fuzz_store_session ] && [ "$(id -u)" -eq 0 ] && command -v ip >/dev/null 2>&1; then
    ns="psgd-fuzz-$$"
    if ip netns add "$ns" && ip -n "$ns" link set lo up &&
       ip netns exec "$ns" sysctl -q -w net.ipv4.tcp_max_tw_buckets=2048 >/dev/null; then
      runner=(ip netns exec "$ns")
    else
      echo "fuzz.sh: warning: no network namespace for $t; a long run may exhaust loopback ports" >&2
    fi
  fi
  # New inputs go to the first directory only, so the repository's seeds are read, never written.
  "${runner[@]}" "$build_dir/tests/fuzz/$t" "$work" "$seeds" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -malloc_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$findings/" >"$log" 2>&1
  rc=$?
  if [ -n "$ns" ]; then ip netns delete "$ns" 2>/dev/null; ns=""; fi
  elapsed=$(( $(date +%s) - start ))
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  last=$(grep -E '^#[0-9]+.*(DONE|cov:)' "$log" | tail -1)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  artifacts=$(find "$findings" -type f ! -name .run-start -newer "$stamp" | wc -l)
  if [ $rc -eq 0 ] && [ "$artifacts" -eq 0 ]; then result=OK; else result=FAIL; failed=$((failed + 1)); fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$result" "${runs:-0}" "${cov:-0}" "${ft:-0}" "$elapsed" >>"$results"
  printf 'fuzz.sh: %-24s %-4s %12s executions  cov %-6s ft %-6s %4ss  (log %s)\n' \
    "$t" "$result" "${runs:-0}" "${cov:-?}" "${ft:-?}" "$elapsed" "$log"
  if [ "$result" = FAIL ]; then
    grep -E 'ERROR|SUMMARY|property violated|Test unit written' "$log" | head -20 >&2
    echo "fuzz.sh: $t: finding(s) in $findings (reproduce: $build_dir/tests/fuzz/$t FILE)" >&2
  fi
done
echo "fuzz.sh: ${#targets[@]} targets, $failed with findings"
[ $failed -eq 0 ]
