# shellcheck shell=sh
# Sourced by the emulated-cluster benchmarks (emulated_training.sh, network_floor.sh):
# emulated_preamble NAME sets RUN and TRAIN from $BUILD, exits 2 when either is
# not built and 77 (skipped) without root, naming the calling script NAME.
emulated_preamble() {
  RUN="$BUILD/tools/run/powersgd-run"
  TRAIN="$BUILD/examples/train-fashion-mnist"
  for f in "$RUN" "$TRAIN"; do
    [ -x "$f" ] || { echo "$1: $f not found (build first: ninja -C $BUILD)" >&2; exit 2; }
  done
  [ "$(id -u)" -eq 0 ] || { echo "$1: needs root (network namespaces)" >&2; exit 77; }
}
