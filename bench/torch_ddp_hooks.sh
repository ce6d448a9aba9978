#!/usr/bin/env bash
# ResNet-18 under DDP on CPU/Gloo with each comm hook, every job under a hard timeout: records whether it
# trains, crashes (and how) or hangs, its mean step time and what of it is compute and what reduction.
#   bench/torch_ddp_hooks.sh BUILD_DIR [RANKS] [BUCKET_CAP_MB] [TIMEOUT_S]
# Local ranks over loopback by default. Environment:
#   LAUNCH_ARGS  powersgd-run options, e.g. an emulated cluster (root): "--emulate-hosts 4 --link-rate 1gbit"
#   CONFIGS      jobs as HOOK@CAP, CAP in MB or "one" (one DDP bucket: first-bucket and bucket cap 1024 MB);
#                default: every hook at BUCKET_CAP_MB (allreduce torch torch-batched ours ours-batched)
#   BATCH_SIZES  images per rank and step, each run with every config (default 16)
#   IMAGE_SIZE   image height and width (default 32, CIFAR)
#   STEPS        training steps per job, the first 5 not timed (default bench/torch_ddp_resnet18.py's, 12)
#   RESULTS_TSV  also append one tab-separated line per job there (input of bench/plot_torch_ddp.py)
#   ROUNDS       run every config and batch size this many times, interleaved (round 1 of each, then round 2,
#                ...), and end with the medians per config and their step-time ratio to DDP's allreduce
#                (default 1)
# The end-to-end comparison of issue 10 (docs/benchmarks.md, "PyTorch DDP, ResNet-18 on 4 emulated hosts"):
#   LAUNCH_ARGS="--emulate-hosts 4 --link-rate 1gbit" CONFIGS="allreduce@25 torch@one ours@25 torch@25" \
#     BATCH_SIZES="16 2" STEPS=25 RESULTS_TSV=/tmp/ddp.tsv bench/torch_ddp_hooks.sh build 4 25 240
# At a distance, beside PyTorch's hook where it runs (docs/scaling.md, "PyTorch DDP at a distance"): the same
# with "--link-delay 5ms" (and "--link-delay 0") in LAUNCH_ARGS and CONFIGS="allreduce@25 torch@one ours@25".
set -uo pipefail
build=${1:?usage: bench/torch_ddp_hooks.sh BUILD_DIR [RANKS] [BUCKET_CAP_MB] [TIMEOUT_S]}
# BUILD_DIR and RESULTS_TSV are the caller's, relative to its directory: absolute before the cd to the source root.
[ -d "$build" ] || { echo "torch_ddp_hooks.sh: $build: no build directory" >&2; exit 2; }
build=$(cd "$build" && pwd) || exit 2
[ -x "$build/tools/run/powersgd-run" ] || {
  echo "torch_ddp_hooks.sh: $build/tools/run/powersgd-run not found (build first: ninja -C $build)" >&2; exit 2; }
tsv=${RESULTS_TSV:-}
case $tsv in ''|/*) ;; *) tsv="$PWD/$tsv" ;; esac
cd "$(dirname "$0")/.." || exit 1
ranks=${2:-4}
cap=${3:-1}
limit=${4:-300}
configs=${CONFIGS:-allreduce@$cap torch@$cap torch-batched@$cap ours@$cap ours-batched@$cap}
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1
if [ -n "$tsv" ] && [ ! -s "$tsv" ]; then
  printf 'hook\tbucket_cap\tbatch\timage\toutcome\tbuckets\tstep_s\tforward_s\tbackward_s\toptimizer_s\tcompute_s\treduction_wait_s\tloadavg\n' > "$tsv"
fi
breakdowns=''
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<< "$2"; }
echo "| hook | bucket cap (MB) | batch | outcome | buckets | mean step (s) | forward / backward / optimizer (s) | compute only (s) | reduction wait (s) | load avg |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
rounds=${ROUNDS:-1}
jobs_tsv=$(mktemp)
log=''
trap 'rm -f "$jobs_tsv" ${log:+"$log"}' EXIT
for _ in $(seq "$rounds"); do
for batch in ${BATCH_SIZES:-16}; do
  for config in $configs; do
    hook=${config%@*}
    bucket=${config#*@}
    if [ "$bucket" = one ]; then
      caps=(--bucket-cap-mb 1024 --first-bucket-mb 1024)
    else
      caps=(--bucket-cap-mb "$bucket")
    fi
    log=$(mktemp)
    # shellcheck disable=SC2086  # LAUNCH_ARGS is a list of options
    "$build/tools/run/powersgd-run" ${LAUNCH_ARGS:-} -n "$ranks" --timeout "$limit" -- /usr/bin/python3 \
      bench/torch_ddp_resnet18.py --hook "$hook" "${caps[@]}" --batch-size "$batch" --image-size "${IMAGE_SIZE:-32}" \
      ${STEPS:+--steps "$STEPS"} > "$log" 2>&1
    rc=$?
    load=$(cut -d' ' -f1 /proc/loadavg)
    result=$(grep -a "RESULT" "$log" | head -1)
    buckets='' step='' forward='' backward='' optimizer='' compute='' wait=''
    if [ $rc -eq 0 ] && [ -n "$result" ]; then
      outcome=trains
      buckets=$(field buckets "$result") step=$(field mean_step_s "$result")
      forward=$(field forward_s "$result") backward=$(field backward_s "$result")
      optimizer=$(field optimizer_s "$result") compute=$(field compute_s "$result")
      wait=$(field reduction_wait_s "$result")
      echo "| $hook | $bucket | $batch | trains | $buckets | $step | $forward / $backward / $optimizer | $compute | $wait | $load |"
    elif [ $rc -eq 124 ]; then
      outcome="hangs (killed by powersgd-run --timeout $limit)"
      echo "| $hook | $bucket | $batch | $outcome | | | | | | $load |"
    else
      # The first line naming the failure: a Gloo enforce, an assertion, a signal.
      why=$(grep -a -m1 -E "enforce fail|Error|error|Assertion|signal|Signal" "$log" | sed 's/^\[[0-9]*\] //; s/|/\\|/g' | cut -c1-160)
      outcome="fails, exit $rc: \`$why\`"
      echo "| $hook | $bucket | $batch | $outcome | | | | | | $load |"
    fi
    if [ -n "$tsv" ]; then
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$hook" "$bucket" "$batch" "${IMAGE_SIZE:-32}" \
        "$(tr '\t' ' ' <<< "$outcome")" "$buckets" "$step" "$forward" "$backward" "$optimizer" "$compute" "$wait" "$load" >> "$tsv"
    fi
    breakdown=$(grep -a -m1 "BREAKDOWN" "$log" | sed 's/^.*BREAKDOWN //')
    [ -n "$breakdown" ] && breakdowns+=$'\n'"- cap $bucket: $breakdown"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$batch" "$config" "$outcome" "$step" "$compute" "$wait" >> "$jobs_tsv"
    cp "$log" "/tmp/torch_ddp_hooks-$hook-$bucket-$batch.log"
    rm -f "$log"
  done
done
done
if [ "$rounds" -gt 1 ]; then
  echo
  echo "Medians over $rounds rounds (jobs that trained):"
  python3 - "$jobs_tsv" <<'PY'
import statistics, sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1])]
keys = list(dict.fromkeys((r[0], r[1]) for r in rows))
print("| batch | config | jobs trained | median step (s) | median compute only (s) | median reduction wait (s) | "
      "allreduce's median step / this |")
print("| --- | --- | --- | --- | --- | --- | --- |")
medians = {}
for batch, config in keys:
    ok = [r for r in rows if (r[0], r[1]) == (batch, config) and r[2] == "trains"]
    if ok:
        medians[batch, config] = [statistics.median(float(r[i]) for r in ok) for i in (3, 4, 5)]
for batch, config in keys:
    jobs = sum(1 for r in rows if (r[0], r[1]) == (batch, config))
    trained = sum(1 for r in rows if (r[0], r[1]) == (batch, config) and r[2] == "trains")
    if (batch, config) not in medians:
        print("| %s | %s | 0 of %d | | | | |" % (batch, config, jobs))
        continue
    step, compute, wait = medians[batch, config]
    reference = [m for (b, c), m in medians.items() if b == batch and c.startswith("allreduce@")]
    ratio = "%.2fx" % (reference[0][0] / step) if reference else ""
    print("| %s | %s | %d of %d | %.3f | %.3f | %.3f | %s |" % (batch, config, trained, jobs, step, compute, wait,
                                                                 ratio))
PY
fi
rm -f "$jobs_tsv"
if [ -n "$breakdowns" ]; then
  echo
  echo "Where our hook's reduction time goes (rank 0, PowerSGDState.timing_breakdown()):$breakdowns"
fi
echo
echo "(full logs: /tmp/torch_ddp_hooks-HOOK-CAP-BATCH.log)"
