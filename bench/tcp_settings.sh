#!/bin/sh
# TCP settings a deployment at a distance may change, side by side in one run on an emulated cluster
# (HOSTS network namespaces, links shaped to RATE, DELAY one way into each host): each side sets per-namespace
# sysctls in every emulated host before the benchmark starts there.
#   default  the namespaces' own settings (this machine: bbr, tcp_wmem max 4 MiB, tcp_rmem max 32 MiB)
#   cubic    net.ipv4.tcp_congestion_control=cubic (Linux's default; added to the host's allowed list for the run)
#   bigbuf   net.ipv4.tcp_wmem and tcp_rmem maxima 32 MiB (the autotuning ceiling of a socket's buffers)
#   idle0    net.ipv4.tcp_slow_start_after_idle=0
# For each: a full allreduce of ResNet-18's gradient (46,758,048 bytes, Gloo's ring, as DDP without
# compression) and PowerSGD's reduction step (powersgd-bench engine, ResNet-18 in 25 MiB buckets, rank 2,
# reduce_all). Sides alternate within each round. Needs root. docs/scaling.md, "TCP".
# Usage: bench/tcp_settings.sh [BUILD_DIR] [HOSTS] [RATE] [ROUNDS]
#   DELAYS ["5ms 25ms"], SIDES ["default cubic bigbuf"], STEPS [8] (engine steps), SHAPES [data/models/resnet18.shapes]
#   e.g. DELAYS=25ms bench/tcp_settings.sh build 4 1gbit 3
set -eu
BUILD=${1:-build}
HOSTS=${2:-4}
RATE=${3:-1gbit}
ROUNDS=${4:-3}
DELAYS=${DELAYS:-5ms 25ms}
SIDES=${SIDES:-default cubic bigbuf}
STEPS=${STEPS:-8}
SHAPES=${SHAPES:-$(dirname "$0")/../data/models/resnet18.shapes}
# shellcheck source=bench/emulated_preamble.sh
. "$(dirname "$0")/emulated_preamble.sh"
emulated_preamble tcp_settings.sh bench
GRADIENT_BYTES=46758048
tmp=$(mktemp -d)
# A namespace may set as its default only a congestion control the host allows: cubic is added for the run
# where the host does not list it (Linux's default, which this machine replaced with bbr), and the list restored.
allowed=$(sysctl -n net.ipv4.tcp_allowed_congestion_control)
trap 'rm -rf "$tmp"; sysctl -qw net.ipv4.tcp_allowed_congestion_control="$allowed"' EXIT
trap 'exit 130' INT  # dash runs the EXIT trap on exit, not when a signal ends it
trap 'exit 143' TERM
case " $SIDES " in *" cubic "*)
  case " $allowed " in *" cubic "*) ;; *) sysctl -qw net.ipv4.tcp_allowed_congestion_control="$allowed cubic" ;; esac ;;
esac
echo "== bench/tcp_settings.sh: $HOSTS hosts, links $RATE, one way $DELAYS, $ROUNDS round(s), sides $SIDES;" \
  "$(date -u '+%Y-%m-%d %H:%M UTC'), load $(cut -d' ' -f1 /proc/loadavg)"

sysctls() {  # side -> the sysctl commands its hosts run first
  case $1 in
    default) echo "true" ;;
    cubic) echo "sysctl -qw net.ipv4.tcp_congestion_control=cubic" ;;
    bigbuf) echo "sysctl -qw net.ipv4.tcp_wmem='4096 16384 33554432' net.ipv4.tcp_rmem='4096 131072 33554432'" ;;
    idle0) echo "sysctl -qw net.ipv4.tcp_slow_start_after_idle=0" ;;
    *) echo "tcp_settings.sh: unknown side '$1' (default, cubic, bigbuf, idle0)" >&2; exit 2 ;;
  esac
}

run() {  # delay side round what: allreduce or engine
  delay=$1 side=$2 round=$3 what=$4
  json="$tmp/$delay-$side-$round-$what.json"
  set -- --min-bytes "$GRADIENT_BYTES" --max-bytes "$GRADIENT_BYTES" --algorithms ring --seconds-per-size 4 \
    --max-iterations 5
  [ "$what" = engine ] && set -- --shapes "$SHAPES" --bucket-mb 25 --rank 2 --steps "$STEPS" --warmup 2 --mode fused
  "$RUN" --emulate-hosts "$HOSTS" --link-rate "$RATE" --link-delay "$delay" -n "$HOSTS" --timeout 900 \
    --env PSGD_BLAS_THREADS=1 --env OPENBLAS_NUM_THREADS=1 \
    -- sh -c "$(sysctls "$side") && exec \"\$0\" \"\$@\"" "$BENCH" "$what" "$@" --json "$json" > "$tmp/log" 2>&1 || {
    echo "tcp_settings.sh: $what, side $side at $delay failed:" >&2; cat "$tmp/log" >&2; exit 1; }
  echo "  $delay, $side, round $round, $what (load $(cut -d' ' -f1 /proc/loadavg))" >&2
}

for side in $SIDES; do sysctls "$side" > /dev/null; done
for delay in $DELAYS; do
  for round in $(seq "$ROUNDS"); do
    for side in $SIDES; do
      run "$delay" "$side" "$round" allreduce
      run "$delay" "$side" "$round" engine
    done
  done
done
/usr/bin/python3 - "$tmp" "$DELAYS" "$ROUNDS" "$SIDES" <<'PY'
import json, os, statistics, sys
tmp, delays, rounds, sides = sys.argv[1], sys.argv[2].split(), int(sys.argv[3]), sys.argv[4].split()
def ms(d, side, r, what):
    doc = json.load(open(os.path.join(tmp, f"{d}-{side}-{r}-{what}.json")))
    return doc["results"][0]["latency_us"] / 1e3 if what == "allreduce" else doc["step_ms_max"]
first = sides[0]
print("| one-way delay | measured | " + " | ".join(f"{s}: ms" for s in sides) + " | "
      + " | ".join(f"{first} / {s} (median of rounds)" for s in sides[1:]) + " |")
print("|" + " --- |" * (2 + 2 * len(sides) - 1))
for d in delays:
    for what, label in (("allreduce", "full allreduce (ring)"), ("engine", "PowerSGD step (reduce_all)")):
        runs = {s: [ms(d, s, r, what) for r in range(1, rounds + 1)] for s in sides}
        cells = [f"{statistics.median(runs[s]):.1f}" for s in sides]
        cells += [f"{statistics.median(a / b for a, b in zip(runs[first], runs[s])):.2f}x" for s in sides[1:]]
        print(f"| {d} | {label} | " + " | ".join(cells) + " |")
PY
