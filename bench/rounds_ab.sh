#!/bin/sh
# The direct algorithm's before/after (issue 28): powersgd-bench engine (the
# reduction alone, no training compute) on emulated clusters of HOSTS hosts
# (one rank each, links shaped to RATE, --link-delay one way into each host),
# with PSGD_DIRECT_MAX_BYTES=0 and PSGD_SCATTER_GATHER=0 (bcube for every allreduce below the ring
# threshold: the algorithms before the direct one) and with the default,
# alternated within each round, ROUNDS rounds. The table gives per side the
# median over rounds of the slowest rank's median step (ms) and of the
# communication rounds per step (Communicator::communication_rounds), and the
# median of the per-round ratios bcube / direct. Needs root.
# Usage: bench/rounds_ab.sh [BUILD_DIR] [RATE] [ROUNDS]
# Environment (defaults in brackets): HOSTS ["4 8"]  DELAYS ["0 5ms"]
#   RANKS_PER_HOST [1]: ranks in each emulated host (powersgd-run --emulate-hosts H -n H*RANKS_PER_HOST;
#         the launcher gives each host a contiguous block of ranks)
#   SHAPES [the source tree's data/models/resnet18.shapes]  BUCKET_MB [25]  STEPS [10]  RANK [2]
#   EXTRA [""] more powersgd-bench engine arguments (e.g. "--alternating")
#   ENV [""] NAME=VALUE settings for every rank of every side (e.g. "PSGD_DIRECT_MAX_BYTES=1048576")
#   SIDES ["bcube direct"]: a side ending in -idle0 also sets net.ipv4.tcp_slow_start_after_idle=0 in
#         each emulated host (a per-namespace sysctl: TCP keeps its window across idle gaps); a side
#         starting with "unfused" sets PSGD_FUSE_REDUCTIONS=0 (each reduction on its own: the engine
#         before fusing queued reductions, docs/engine.md); a side named directNk (e.g. direct1024k) sets
#         PSGD_DIRECT_MAX_BYTES=N KiB (direct256k: the default before auto), one named directauto
#         PSGD_DIRECT_MAX_BYTES=auto (the default, with scatter-gather on); a side starting with
#         "staged" sets PSGD_HOST_STAGE=1 (the host-staged allreduce, docs/transport.md: with RANKS_PER_HOST
#         above 1 only the hosts' leaders cross the network), e.g. SIDES="direct staged"; one starting with
#         "unstaged" PSGD_HOST_STAGE=0 (since 2026-12-04 the default, auto, stages where RANKS_PER_HOST is
#         above 1; before, no side staged unless "staged"), e.g. SIDES="unstaged directauto"; a side starting with
#         "noeager" sets PSGD_DIRECT_EAGER=0 (each direct exchange waits for Gloo's ready-to-receive notices:
#         the transport before the eager direct allreduce, docs/transport.md), e.g. SIDES="noeager direct"; a side
#         starting with "nosg" sets PSGD_SCATTER_GATHER=0 (Gloo's bcube between the direct bound and the ring
#         threshold: the algorithms before the scatter-gather allreduce), e.g. SIDES="nosg direct"; a side
#         containing "nocarry" sets PSGD_CARRY_FIRST=0 (the order guard's announce carries no P: the
#         engine before the lead exchange, docs/engine.md), e.g. SIDES="nocarry direct" or
#         SIDES="staged-nocarry staged"; a side containing "tcphops" sets PSGD_HOST_SHM=0 (the hops within a
#         host over loopback TCP: the transport before shared memory, docs/transport.md), e.g. with
#         RANKS_PER_HOST=2 SIDES="tcphops shm"; a side starting with "old" runs OLD_BUILD's powersgd-bench (a
#         build of the commit before a change, for its before and after side by side), e.g.
#         OLD_BUILD=/tmp/old/build SIDES="old new"; a side ending in @MODE runs powersgd-bench engine --mode MODE
#         (sync, async or fused: reduce per bucket, all in flight, or reduce_all), e.g. SIDES="new new@fused"
#         (@MODE last: "direct-idle0@fused"); a side with -chN before any @MODE runs N channels, at most one
#         per bucket (e.g. "directauto-ch2@async", "direct-idle0-ch2"; not with an "old" side's build before it)
#         (powersgd-bench engine --channels N: N communicators, each with its Reducer, bucket b on channel
#         b % N, their collectives overlapping on the wire), e.g. SIDES="directauto@fused directauto-ch2"
set -eu
BUILD=${1:-build}
RATE=${2:-1gbit}
ROUNDS=${3:-3}
HOSTS=${HOSTS:-4 8}
DELAYS=${DELAYS:-0 5ms}
SHAPES=${SHAPES:-$(dirname "$0")/../data/models/resnet18.shapes}
BUCKET_MB=${BUCKET_MB:-25}
STEPS=${STEPS:-10}
RANK=${RANK:-2}
RANKS_PER_HOST=${RANKS_PER_HOST:-1}
case $RANKS_PER_HOST in ''|*[!0-9]*|0) echo "rounds_ab.sh: RANKS_PER_HOST='$RANKS_PER_HOST': expected an integer >= 1" >&2; exit 2 ;; esac
EXTRA=${EXTRA:-}
ENV_ARGS=
for setting in ${ENV:-}; do ENV_ARGS="$ENV_ARGS --env $setting"; done
# shellcheck source=bench/emulated_preamble.sh
. "$(dirname "$0")/emulated_preamble.sh"
emulated_preamble rounds_ab.sh bench
case " ${SIDES:-} " in *" old"*)
  [ -x "${OLD_BUILD:-}/tools/bench/powersgd-bench" ] || {
    echo "rounds_ab.sh: a side starting with 'old' needs OLD_BUILD, a build with tools/bench/powersgd-bench (OLD_BUILD='${OLD_BUILD:-}')" >&2; exit 2; } ;;
esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
trap 'exit 130' INT  # dash runs the EXIT trap on exit, not when a signal ends it
trap 'exit 143' TERM
echo "== bench/rounds_ab.sh: links $RATE, $ROUNDS round(s), $RANKS_PER_HOST rank(s) per host, $(basename "$SHAPES"), buckets $BUCKET_MB MiB," \
  "rank $RANK, $STEPS steps ${EXTRA:+($EXTRA) }${ENV:+($ENV) }; $(date -u '+%Y-%m-%d %H:%M UTC'), load $(cut -d' ' -f1 /proc/loadavg)"
SIDES=${SIDES:-bcube direct}
for hosts in $HOSTS; do
  for delay in $DELAYS; do
    for round in $(seq "$ROUNDS"); do
      for side in $SIDES; do
        direct=; case $side in bcube*) direct=0 ;; directauto*) direct=auto ;; direct[0-9]*k*) direct=${side#direct}; direct=$((${direct%%k*} * 1024)) ;; esac
        fuse=; case $side in unfused*) fuse=0 ;; esac
        idle=; case $side in *-idle0|*-idle0@*|*-idle0-*) idle=0 ;; esac
        stage=; case $side in staged*) stage=1 ;; unstaged*) stage=0 ;; esac
        eager=; case $side in noeager*) eager=0 ;; esac
        sg=; case $side in nosg*|bcube*) sg=0 ;; esac
        carry=; case $side in *nocarry*) carry=0 ;; esac
        shm=; case $side in *tcphops*) shm=0 ;; esac
        bench=$BENCH; case $side in old*) bench="$OLD_BUILD/tools/bench/powersgd-bench" ;; esac
        mode=; case $side in *@*) mode=${side##*@} ;; esac
        channels=; case ${side%%@*} in *-ch[0-9]*) channels=${side%%@*}; channels=${channels##*-ch}; channels=${channels%%[!0-9]*} ;; esac
        json="$tmp/$hosts-$delay-$side-$round.json"
        # shellcheck disable=SC2086  # EXTRA: arguments without blanks
        "$RUN" --emulate-hosts "$hosts" --link-rate "$RATE" --link-delay "$delay" -n $((hosts * RANKS_PER_HOST)) \
          --timeout 900 --env PSGD_BLAS_THREADS=1 --env OPENBLAS_NUM_THREADS=1 \
          ${direct:+--env PSGD_DIRECT_MAX_BYTES=$direct} ${fuse:+--env PSGD_FUSE_REDUCTIONS=$fuse} \
          ${stage:+--env PSGD_HOST_STAGE=$stage} ${eager:+--env PSGD_DIRECT_EAGER=$eager} \
          ${sg:+--env PSGD_SCATTER_GATHER=$sg} ${carry:+--env PSGD_CARRY_FIRST=$carry} ${shm:+--env PSGD_HOST_SHM=$shm} $ENV_ARGS \
          -- sh -c "${idle:+sysctl -qw net.ipv4.tcp_slow_start_after_idle=$idle && }exec \"\$0\" \"\$@\"" \
          "$bench" engine --shapes "$SHAPES" --bucket-mb "$BUCKET_MB" --rank "$RANK" --steps "$STEPS" \
          --warmup 2 --json "$json" ${mode:+--mode "$mode"} ${channels:+--channels "$channels"} $EXTRA > "$tmp/log" 2>&1 || {
          echo "rounds_ab.sh: $side on $hosts hosts at $delay failed:" >&2; cat "$tmp/log" >&2; exit 1; }
        echo "  $hosts hosts, $delay, $side, round $round (load $(cut -d' ' -f1 /proc/loadavg))" >&2
      done
    done
  done
done
/usr/bin/python3 - "$tmp" "$HOSTS" "$DELAYS" "$ROUNDS" "$SIDES" <<'PY'
import json, os, statistics, sys
tmp, hosts, delays, rounds = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), int(sys.argv[4])
sides = sys.argv[5].split()
def load(h, d, side, r):
    doc = json.load(open(os.path.join(tmp, f"{h}-{d}-{side}-{r}.json")))
    return doc["step_ms_max"], doc["rounds_per_step"]
first = sides[0]
print("| hosts | one-way delay | " + " | ".join(f"{x} (ms/step) | rounds/step" for x in sides) + " | "
      + " | ".join(f"{first} / {x} (median of rounds)" for x in sides[1:]) + " |")
print("|" + " --- |" * (2 + 2 * len(sides) + len(sides) - 1))
for h in hosts:
    for d in delays:
        runs = {x: [load(h, d, x, r) for r in range(1, rounds + 1)] for x in sides}
        cells = [f"{statistics.median(v[0] for v in runs[x]):.1f} | {statistics.median(v[1] for v in runs[x]):g}" for x in sides]
        cells += [f"{statistics.median(a[0] / b[0] for a, b in zip(runs[first], runs[x])):.2f}x" for x in sides[1:]]
        print(f"| {h} | {d} | " + " | ".join(cells) + " |")
PY
