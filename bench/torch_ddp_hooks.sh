#!/usr/bin/env bash
# ResNet-18 under DDP on CPU/Gloo with each comm hook, every job under a hard timeout: records whether it
# trains, crashes (and how) or hangs, and its mean step time.
#   bench/torch_ddp_hooks.sh BUILD_DIR [RANKS] [BUCKET_CAP_MB] [TIMEOUT_S]
# Local ranks over loopback by default; LAUNCH_ARGS adds powersgd-run options, e.g. an emulated cluster
# (root): LAUNCH_ARGS="--emulate-hosts 4 --link-rate 1gbit" bench/torch_ddp_hooks.sh build 4
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: bench/torch_ddp_hooks.sh BUILD_DIR [RANKS] [BUCKET_CAP_MB] [TIMEOUT_S]}
ranks=${2:-4}
cap=${3:-1}
limit=${4:-300}
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1
echo "| hook | outcome | buckets | mean step (s) |"
echo "| --- | --- | --- | --- |"
for hook in allreduce torch torch-batched ours ours-batched; do
  log=$(mktemp)
  # shellcheck disable=SC2086  # LAUNCH_ARGS is a list of options
  "$build/tools/run/powersgd-run" ${LAUNCH_ARGS:-} -n "$ranks" --timeout "$limit" -- /usr/bin/python3 bench/torch_ddp_resnet18.py \
    --hook "$hook" --bucket-cap-mb "$cap" > "$log" 2>&1
  rc=$?
  result=$(grep -a "RESULT" "$log" | head -1)
  if [ $rc -eq 0 ] && [ -n "$result" ]; then
    buckets=$(sed -n 's/.*buckets=\([^ ]*\).*/\1/p' <<< "$result")
    step=$(sed -n 's/.*mean_step_s=\([^ ]*\).*/\1/p' <<< "$result")
    echo "| $hook | trains | $buckets | $step |"
  elif [ $rc -eq 124 ]; then
    echo "| $hook | hangs (killed by powersgd-run --timeout $limit) | | |"
  else
    # The first line naming the failure: a Gloo enforce, an assertion, a signal.
    why=$(grep -a -m1 -E "enforce fail|Error|error|Assertion|signal|Signal" "$log" | sed 's/^\[[0-9]*\] //; s/|/\\|/g' | cut -c1-160)
    echo "| $hook | fails, exit $rc: \`$why\` | | |"
  fi
  cp "$log" "/tmp/torch_ddp_hooks-$hook.log"
  rm -f "$log"
done
echo
echo "(full logs: /tmp/torch_ddp_hooks-HOOK.log)"
