# shellcheck shell=sh
# Sourced by the emulated-cluster benchmarks: emulated_preamble NAME TOOL... sets
# RUN (the launcher, always needed), TRAIN (the example trainer) and BENCH
# (powersgd-bench) from $BUILD; exits 2 when the launcher or a TOOL named
# (train, bench) is not built, and 77 (skipped) without root, naming the calling
# script NAME.
emulated_preamble() {
  name=$1
  shift
  RUN="$BUILD/tools/run/powersgd-run"
  TRAIN="$BUILD/examples/train-fashion-mnist"
  BENCH="$BUILD/tools/bench/powersgd-bench"
  for tool in run "$@"; do
    case $tool in
      run) f=$RUN ;;
      train) f=$TRAIN ;;
      bench) f=$BENCH ;;
      *) echo "emulated_preamble: unknown tool '$tool' (expected train or bench)" >&2; exit 2 ;;
    esac
    [ -x "$f" ] || { echo "$name: $f not found (build first: ninja -C $BUILD)" >&2; exit 2; }
  done
  [ "$(id -u)" -eq 0 ] || { echo "$name: needs root (network namespaces)" >&2; exit 77; }
}
