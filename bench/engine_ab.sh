#!/bin/sh
# Two builds' single-process engine step side by side, alternated in one run (a
# shared machine's load moves between runs; alternation exposes both builds to
# it alike): each round runs A then B on every shapes file, and the table gives
# each run's median step, its minimal-traffic time (28 bytes per compressed
# element at the STREAM bandwidth measured in that run) and their ratio, then
# per build and model the lowest and the median ratio over the rounds.
# Usage: bench/engine_ab.sh BUILD_A BUILD_B ROUNDS RANK SHAPES... [-- extra powersgd-bench arguments]
#   e.g. bench/engine_ab.sh /work/main/build build 5 2 data/models/resnet18.shapes data/models/resnet50.shapes
# Environment: ENV_A / ENV_B (e.g. "PSGD_CPU_KERNELS=sse2 PSGD_BLAS_THREADS=1"), STEPS (default 20).
set -eu
[ $# -ge 5 ] || { sed -n '2,12p' "$0" >&2; exit 2; }
A=$1 B=$2 ROUNDS=$3 RANK=$4
shift 4
SHAPES=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do SHAPES="$SHAPES $1"; shift; done
[ $# -gt 0 ] && shift
STEPS=${STEPS:-20}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
trap 'exit 130' INT  # dash runs the EXIT trap on exit, not when a signal ends it
trap 'exit 143' TERM
for r in $(seq "$ROUNDS"); do
  for s in $SHAPES; do
    for side in A B; do
      if [ $side = A ]; then build=$A env_vars=${ENV_A:-}; else build=$B env_vars=${ENV_B:-}; fi
      out="$tmp/$side-$(basename "$s" .shapes)-$r.json"
      # shellcheck disable=SC2086
      env $env_vars "$build/tools/bench/powersgd-bench" engine --shapes "$s" --rank "$RANK" --steps "$STEPS" \
        --json "$out" "$@" > /dev/null
    done
  done
done
/usr/bin/python3 - "$tmp" "$A${ENV_A:+ ($ENV_A)}" "$B${ENV_B:+ ($ENV_B)}" <<'PY'
import glob, json, os, statistics, sys
tmp, names = sys.argv[1], {"A": sys.argv[2], "B": sys.argv[3]}
rows = {}
for f in sorted(glob.glob(os.path.join(tmp, "*.json"))):
    side, rest = os.path.basename(f)[:-5].split("-", 1)
    model, rnd = rest.rsplit("-", 1)
    d = json.load(open(f))
    rows.setdefault(model, {}).setdefault(int(rnd), {})[side] = d
print("| model | round | A step (ms) | A minimal (ms) | A ratio | B step (ms) | B minimal (ms) | B ratio | B/A step |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for model, rounds in rows.items():
    for rnd in sorted(rounds):
        a, b = rounds[rnd]["A"], rounds[rnd]["B"]
        sa, sb = a["step_ms_per_rank"][0], b["step_ms_per_rank"][0]
        print(f"| {model} | {rnd} | {sa:.2f} | {a['minimal_traffic_ms']:.2f} | {a['ratio_to_minimal']:.2f} | "
              f"{sb:.2f} | {b['minimal_traffic_ms']:.2f} | {b['ratio_to_minimal']:.2f} | {sb / sa:.2f} |")
print()
for side in "AB":
    print(f"{side} = {names[side]}")
    for model, rounds in rows.items():
        ratios = [rounds[r][side]["ratio_to_minimal"] for r in rounds]
        steps = [rounds[r][side]["step_ms_per_rank"][0] for r in rounds]
        print(f"  {model}: ratio to the minimal traffic lowest {min(ratios):.2f}, median {statistics.median(ratios):.2f}; "
              f"step lowest {min(steps):.2f} ms, median {statistics.median(steps):.2f} ms")
PY
