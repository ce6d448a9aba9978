#!/bin/sh
# PowerSGD at a distance (issue 28): the example trainer on emulated clusters of
# HOSTS hosts (one rank each, links shaped to RATE, --link-delay one way into
# each host), once per configuration: full allreduce (--no-compression),
# PowerSGD with the default config, and --alternating (one collective per
# step); and, once per round and number of hosts, PowerSGD's no-network floor
# (the same job with links unshaped and undelayed: veth at memory speed, what
# it costs when the network costs nothing). Configurations alternate within
# each round, ROUNDS rounds; the table gives the median time per step and the
# ratios. Needs root.
# Usage: bench/scaling.sh [BUILD_DIR] [RATE] [ROUNDS]
#   e.g. bench/scaling.sh build 1gbit 3
# Environment (defaults in brackets):
#   HOSTS ["4 8 16"]  DELAYS ["0 1ms 5ms 25ms"]
#   MODEL [wide]      the trainer's model for up to 8 hosts (784-1024-1024-10, 1.9M parameters)
#   MODEL_16 [mlp]    for more than 8 hosts, where 16 processes on 2 cores would measure only the cores
#   TRAIN_LIMIT [8192] BATCH [256]: TRAIN_LIMIT / BATCH steps per epoch, rounded down as the trainer does
#                     (TRAIN_LIMIT 0: all 60000 images; the global batch is split over ranks); the trainer
#                     prints the epoch to 0.1 s, so 32 steps resolve about 3 ms per step
#   RANK [2]          PowerSGD rank
#   FLOOR [1]         0: no floor runs
#   RESULTS_TSV       also write every run's figures there (for bench/plot_scaling.py)
#   CONFIGS ["allreduce powersgd alternating"]: also powersgd-each (PowerSGD with the trainer's
#                     --submit each: one reduction per bucket, as before 2026-12-04, where the default
#                     submits both buckets in one reduce_all), powersgd-bcube (PowerSGD with
#                     PSGD_DIRECT_MAX_BYTES=0 and PSGD_SCATTER_GATHER=0: bcube for every small
#                     allreduce, as before the direct and scatter-gather algorithms) and powersgd-before (PowerSGD with the trainer BEFORE, e.g.
#                     one copied from an older build with its libpowersgd beside it in ../src)
# Time: the trainer's own "epoch 1: ... N s" (its first step to the end of the
# epoch's test pass of 500 images; start-up and data loading excluded), rank 0,
# divided by the steps.
set -eu
BUILD=${1:-build}
RATE=${2:-1gbit}
ROUNDS=${3:-3}
HOSTS=${HOSTS:-4 8 16}
DELAYS=${DELAYS:-0 1ms 5ms 25ms}
MODEL=${MODEL:-wide}
MODEL_16=${MODEL_16:-mlp}
TRAIN_LIMIT=${TRAIN_LIMIT:-8192}
BATCH=${BATCH:-256}
RANK=${RANK:-2}
CONFIGS=${CONFIGS:-allreduce powersgd alternating}
BEFORE=${BEFORE:-}
FLOOR=${FLOOR:-1}
RESULTS_TSV=${RESULTS_TSV:-}
# shellcheck source=bench/emulated_preamble.sh
. "$(dirname "$0")/emulated_preamble.sh"
emulated_preamble scaling.sh train
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
trap 'exit 130' INT  # dash runs the EXIT trap on exit, not when a signal ends it
trap 'exit 143' TERM
# The trainer's steps per epoch: floor(training images / global batch), the rest of the images left out; its
# --train-limit 0 trains on all 60,000.
case $TRAIN_LIMIT$BATCH in *[!0-9]*) echo "scaling.sh: TRAIN_LIMIT and BATCH: expected integers" >&2; exit 2 ;; esac
[ "$BATCH" -gt 0 ] || { echo "scaling.sh: BATCH=$BATCH: expected a global batch >= 1" >&2; exit 2; }
steps=$(( (TRAIN_LIMIT > 0 ? TRAIN_LIMIT : 60000) / BATCH ))
[ "$steps" -gt 0 ] || {
  echo "scaling.sh: TRAIN_LIMIT=$TRAIN_LIMIT images at BATCH=$BATCH make 0 steps per epoch: expected TRAIN_LIMIT" \
    ">= BATCH (or 0: all 60000)" >&2
  exit 2
}

run() {  # hosts model delay config round trainer-options...
  hosts=$1 model=$2 delay=$3 config=$4 round=$5
  shift 5
  log="$tmp/run.log"
  train=$TRAIN direct=
  shaping="--link-rate $RATE --link-delay $delay"
  case $config in
    floor) shaping= ;;
    allreduce) set -- "$@" --no-compression ;;
    alternating) set -- "$@" --alternating ;;
    powersgd-each) set -- "$@" --submit each ;;
    powersgd-bcube) direct=0 ;;
    powersgd-before) train=$BEFORE; [ -x "$train" ] || { echo "scaling.sh: BEFORE='$BEFORE' is no trainer" >&2; exit 2; } ;;
  esac
  # shellcheck disable=SC2086  # trainer options and $shaping without blanks
  "$RUN" --emulate-hosts "$hosts" $shaping -n "$hosts" --timeout 1800 \
    --env PSGD_BLAS_THREADS=1 --env OPENBLAS_NUM_THREADS=1 ${direct:+--env PSGD_DIRECT_MAX_BYTES=$direct} \
    ${direct:+--env PSGD_SCATTER_GATHER=0} \
    -- "$train" --model "$model" --rank "$RANK" \
    --start-iter 0 --epochs 1 --train-limit "$TRAIN_LIMIT" --test-limit 500 --batch "$BATCH" "$@" > "$log" 2>&1 || {
    echo "scaling.sh: $config on $hosts hosts at $delay (round $round) failed; its output:" >&2
    cat "$log" >&2
    exit 1
  }
  seconds=$(sed -n 's/^\(\[0\] \)\{0,1\}epoch [0-9]*: .*, \([0-9.]*\) s, lr .*/\2/p' "$log" | tail -1)
  [ -n "$seconds" ] || { echo "scaling.sh: no epoch line for $config on $hosts hosts at $delay" >&2; cat "$log" >&2; exit 1; }
  # Trainers before the count print no rounds: "-".
  rounds=$(sed -n 's/^\(\[0\] \)\{0,1\}epoch [0-9]*: .*, \([0-9.]*\) communication rounds per step$/\2/p' "$log" | tail -1)
  echo "$hosts $model $delay $config $round $seconds ${rounds:--} $(cut -d' ' -f1 /proc/loadavg)" >> "$tmp/times"
  echo "  $hosts hosts, $delay, $config, round $round: $seconds s, ${rounds:--} rounds per step" \
    "(load $(cut -d' ' -f1 /proc/loadavg))" >&2
}

echo "== bench/scaling.sh: links $RATE, $ROUNDS round(s), $steps steps per epoch (--train-limit $TRAIN_LIMIT," \
  "--batch $BATCH), PowerSGD rank $RANK; $(date -u '+%Y-%m-%d %H:%M UTC'), load $(cut -d' ' -f1 /proc/loadavg)"
for hosts in $HOSTS; do
  model=$MODEL
  [ "$hosts" -le 8 ] || model=$MODEL_16
  if [ "$FLOOR" != 0 ]; then
    for round in $(seq "$ROUNDS"); do run "$hosts" "$model" - floor "$round"; done
  fi
  for delay in $DELAYS; do
    for round in $(seq "$ROUNDS"); do
      for config in $CONFIGS; do run "$hosts" "$model" "$delay" "$config" "$round"; done
    done
  done
done
if [ -n "$RESULTS_TSV" ]; then
  { printf 'hosts\tmodel\tdelay\tconfig\tround\tepoch_s\trounds_per_step\tload\tsteps\n'
    sed "s/ /\t/g; s/\$/\t$steps/" "$tmp/times"; } > "$RESULTS_TSV"
fi

/usr/bin/python3 - "$tmp/times" "$steps" "$CONFIGS" <<'PY'
import collections, statistics, sys
steps = int(sys.argv[2])
configs = sys.argv[3].split()
times = collections.defaultdict(list)
rounds = collections.defaultdict(list)
order = []
for hosts, model, delay, config, _round, seconds, r, _load in (line.split() for line in open(sys.argv[1])):
    key = (int(hosts), model, delay)
    if key not in order and config != "floor":
        order.append(key)
    times[key + (config,)].append(float(seconds) * 1000 / steps)
    rounds[key + (config,)].append(r)
ms = {k: statistics.median(v) for k, v in times.items()}
def median_rounds(values):
    """The median of the rounds' communication rounds per step; "-" where a trainer printed none."""
    known = [float(v) for v in values if v != "-"]
    if not known:
        return "-"
    median = statistics.median(known)
    return f"{median:.1f}" if abs(round(median, 1) - median) < 1e-9 else f"{median:.2f}"  # the trainer's %.1f
rounds = {k: median_rounds(v) for k, v in rounds.items()}
floor = {(k[0], k[1]): v for k, v in ms.items() if k[3] == "floor"}
ratios = [c for c in configs if c != "allreduce"] if "allreduce" in configs else []
head = ["hosts", "model", "one-way delay"] + [f"{c} (ms/step, rounds/step)" for c in configs]
head += [f"allreduce / {c}" for c in ratios]
head += ["PowerSGD / its step without delay"] if "powersgd" in configs else []
head += ["PowerSGD / its no-network floor"] if "powersgd" in configs and floor else []
print("| " + " | ".join(head) + " |")
print("|" + " --- |" * len(head))
for hosts, model, delay in order:
    k = (hosts, model, delay)
    cells = [str(hosts), model, delay] + [f"{ms[k + (c,)]:.1f} ({rounds[k + (c,)]})" for c in configs]
    cells += [f"{ms[k + ('allreduce',)] / ms[k + (c,)]:.2f}x" for c in ratios]
    if "powersgd" in configs:
        base = ms.get((hosts, model, "0", "powersgd"))
        cells.append(f"{ms[k + ('powersgd',)] / base:.2f}x" if base else "-")
        if floor:
            least = floor.get((hosts, model))
            cells.append(f"{ms[k + ('powersgd',)] / least:.2f}x" if least else "-")
    print("| " + " | ".join(cells) + " |")
for (hosts, model), value in floor.items():
    print(f"no-network floor, {hosts} hosts, {model}: {value:.1f} ms/step "
          f"({rounds[(hosts, model, '-', 'floor')]} rounds/step; PowerSGD, links unshaped)")
PY
