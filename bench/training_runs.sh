# shellcheck shell=sh
# shellcheck disable=SC2154  # warmup, boost and interval are the caller's
# Sourced by bench/paper_table.sh and bench/time_to_accuracy.sh, which run the
# example trainer once per row:
#   row_args ROW     the trainer's arguments of one row of the paper's table (the
#                    row names are listed in paper_table.sh); reads POLICY_LOW,
#                    POLICY_HIGH, OUTER_LR, OUTER_MOMENTUM and the caller's
#                    per-model warmup, boost and interval (steps);
#   decay_args EPOCHS  the schedule's arguments: the learning rate times 0.1 from
#                    60% and again from 80% of the epochs, each from the epoch in
#                    which that share is reached (epochs 3 and 4 of 4, 5 and 7 of
#                    8, 10 and 13 of 16); none in a single epoch, one where both
#                    fall in the same epoch (2 epochs: from epoch 2);
#   finished LOG [CMD]  whether LOG holds a finished run (of the command line CMD:
#                    its first line is "$ CMD");
#   run_logged LOG CMD  runs the command line CMD (split on blanks) with its output
#                    in LOG, after a first line "$ CMD" and the load, and before
#                    the load and wall time; prints the last epoch line or the
#                    failure; returns CMD's status.
ALL_ROWS="allreduce rank1 rank2 rank4 rank8 rank2-no-ef rank2-no-warm-start adaptive policy policy-adaptive alternating rank2-bf16"
ALL_ROWS="$ALL_ROWS policy-4-8 policy-adaptive-4-8 policy-warmup-4-8"
POLICY_LOW=${POLICY_LOW:-2}
POLICY_HIGH=${POLICY_HIGH:-8}
row_args() {  # row -> the trainer's arguments of that row
  case $1 in
    allreduce) echo "--no-compression" ;;
    rank1) echo "--rank 1" ;;
    rank2) echo "--rank 2" ;;
    rank4) echo "--rank 4" ;;
    rank8) echo "--rank 8" ;;
    rank2-no-ef) echo "--rank 2 --no-error-feedback" ;;
    rank2-no-warm-start) echo "--rank 2 --no-warm-start" ;;
    adaptive) echo "--adaptive --rank-low $POLICY_LOW --rank-high $POLICY_HIGH --adaptive-interval $interval" ;;
    policy) echo "--rank $POLICY_LOW --rank-high $POLICY_HIGH --warmup-steps $warmup --lr-boost-steps $boost --lr-notes" ;;
    policy-adaptive) echo "--adaptive --rank-low $POLICY_LOW --rank-high $POLICY_HIGH --adaptive-interval $interval" \
      "--warmup-steps $warmup --lr-boost-steps $boost --lr-notes" ;;
    # The policy from rank 4 instead of POLICY_LOW (with and without the norm-change rule), and its warm-up alone
    # (no learning-rate notes), which separates the warm-up's effect from the boosts'.
    policy-4-8) echo "--rank 4 --rank-high 8 --warmup-steps $warmup --lr-boost-steps $boost --lr-notes" ;;
    policy-adaptive-4-8) echo "--adaptive --rank-low 4 --rank-high 8 --adaptive-interval $interval" \
      "--warmup-steps $warmup --lr-boost-steps $boost --lr-notes" ;;
    policy-warmup-4-8) echo "--rank 4 --rank-high 8 --warmup-steps $warmup" ;;
    alternating) echo "--rank 2 --alternating" ;;
    rank2-bf16) echo "--rank 2 --wire-dtype bf16" ;;
    local*)
      h=$(echo "$1" | sed -n 's/^local\([0-9][0-9]*\)\(-rank[0-9][0-9]*\)\{0,1\}\(-no-ef\)\{0,1\}$/\1/p')
      [ -n "$h" ] || { echo "${0##*/}: row '$1': expected localH, localH-rankR or localH-rankR-no-ef" >&2; return 2; }
      r=$(echo "$1" | sed -n 's/^local[0-9]*-rank\([0-9][0-9]*\).*/\1/p')
      outer="${OUTER_LR:+ --outer-lr $OUTER_LR}${OUTER_MOMENTUM:+ --outer-momentum $OUTER_MOMENTUM}"
      case $1 in
        *-no-ef) echo "--rank $r --local-steps $h --no-error-feedback$outer" ;;
        *-rank*) echo "--rank $r --local-steps $h$outer" ;;
        *) echo "--no-compression --local-steps $h$outer" ;;
      esac ;;
    *) echo "${0##*/}: unknown row '$1' in ROWS (expected some of: $ALL_ROWS)" >&2; return 2 ;;
  esac
}

decay_args() {  # EPOCHS -> the trainer's decay options
  # The trainer's --lr-decay-epochs are 1-based: "a" decays from epoch a on, after a - 1 epochs. A share s of the
  # run is reached in epoch floor(s E) + 1 (0-based floor(s E)). A decay from epoch 1 is the whole run at a lower
  # rate, not a schedule: none then (a single epoch); a second decay in the first's epoch is left out. Without
  # --lr-decay-epochs the trainer decays in its last epoch when --epochs > 2: "--lr-decay-factor 1" turns that off.
  da_first=$(($1 * 6 / 10 + 1)) da_second=$(($1 * 8 / 10 + 1))
  [ "$da_second" -gt "$da_first" ] || da_second=$((da_first + 1))
  if [ "$da_first" -lt 2 ] || [ "$da_first" -gt "$1" ]; then
    echo "--lr-decay-factor 1"
  elif [ "$da_second" -gt "$1" ]; then
    echo "--lr-decay-epochs $da_first --lr-decay-factor 0.1"
  else
    echo "--lr-decay-epochs $da_first,$da_second --lr-decay-factor 0.1"
  fi
}

# A finished run: the trainer's last line is there; with CMD, also the log's first line is "$ CMD" (run_logged's),
# so a log of other arguments (another build, epochs, limits, rows' options) is run again.
finished() {
  [ -f "$1" ] && grep -qE "^\[0\] (PowerSGD: .*sent per rank in all|sent .* MB of gradients per rank)" "$1" &&
    { [ $# -lt 2 ] || [ "$(head -n 1 "$1")" = "\$ $2" ]; }
}

run_logged() {
  run_log=$1 run_cmd=$2 run_status=0
  printf '$ %s\n' "$run_cmd"
  {
    printf '$ %s\n' "$run_cmd"  # the first line: finished LOG CMD compares it
    echo "# load before: $(cut -d' ' -f1-3 /proc/loadavg); started $(date -u +%FT%TZ)"
  } > "$run_log"
  run_start=$(date +%s)
  # shellcheck disable=SC2086  # the argument lists are meant to split
  $run_cmd >> "$run_log" 2>&1 || run_status=$?
  if [ "$run_status" = 0 ]; then
    grep -E "^\[0\] epoch" "$run_log" | tail -n 1
  else
    echo "   failed (status $run_status), see $run_log"
  fi
  echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg); wall $(($(date +%s) - run_start)) s" >> "$run_log"
  return "$run_status"
}
