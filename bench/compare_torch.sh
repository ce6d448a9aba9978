#!/bin/sh
# Per-step time of powersgd's engine vs PyTorch's powerSGD_hook, N processes on
# loopback (127.0.0.1), same model shapes, rank 2, compressed steps, one bucket.
# Usage: bench/compare_torch.sh [BUILD_DIR] [SHAPES] [N]   (from the source root)
# Prints both times and their ratio; writes bench-ours.json, bench-torch.json and
# bench-compare.json into $OUT_DIR (default: the current directory).
set -eu
BUILD=${1:-build}
SHAPES=${2:-$(dirname "$0")/../data/models/resnet18.shapes}
N=${3:-4}
OUT_DIR=${OUT_DIR:-.}
STEPS=${STEPS:-10}
RUN="$BUILD/tools/run/powersgd-run"
BENCH="$BUILD/tools/bench/powersgd-bench"
for f in "$RUN" "$BENCH" "$SHAPES"; do
  [ -e "$f" ] || { echo "compare_torch.sh: $f not found (build first: ninja -C $BUILD)" >&2; exit 2; }
done
/usr/bin/python3 -c 'import torch' 2>/dev/null || { echo "compare_torch.sh: python3-torch is not installed" >&2; exit 77; }

# One BLAS/torch thread per process for both: N processes share the cores.
echo "== powersgd engine ($N processes)"
PSGD_BLAS_THREADS=1 "$RUN" -n "$N" --timeout 600 --env PSGD_BLAS_THREADS=1 -- \
  "$BENCH" engine --shapes "$SHAPES" --rank 2 --steps "$STEPS" --json "$OUT_DIR/bench-ours.json"

echo "== PyTorch powerSGD_hook ($N processes)"
PORT=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# The ranks run in the background (where a script's commands ignore SIGINT), each under timeout(1), which puts
# itself in a process group of its own: a Ctrl-C at the terminal does not reach them. "running" holds "pid:rank"
# of those not yet waited for; whatever ends the script (an error, a failed rank, INT, TERM) stops them (timeout
# passes the TERM on to its rank).
running=""
stop_ranks() {
  for job in $running; do kill "${job%%:*}" 2>/dev/null || :; done
  for job in $running; do wait "${job%%:*}" 2>/dev/null || :; done
  running=""
}
trap stop_ranks EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
r=0
while [ "$r" -lt "$N" ]; do
  RANK=$r WORLD_SIZE=$N MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT GLOO_SOCKET_IFNAME=lo TORCH_THREADS=1 \
    timeout 600 /usr/bin/python3 "$(dirname "$0")/torch_powersgd.py" --shapes "$SHAPES" --rank 2 \
    --steps "$STEPS" --json "$OUT_DIR/bench-torch.json" &
  running="$running $!:$r"
  r=$((r + 1))
done
# Wait for all; the first rank that fails stops the others at once (they would wait for it until the timeout).
# The shell reaps an exited rank while it waits for the foreground sleep: kill -0 then fails, wait gives its status.
failed=""
while [ -n "$running" ]; do
  still=""
  for job in $running; do
    if [ -n "$failed" ] || kill -0 "${job%%:*}" 2>/dev/null; then
      still="$still $job"
      continue
    fi
    status=0
    wait "${job%%:*}" || status=$?
    if [ "$status" -eq 124 ]; then
      failed="torch rank ${job#*:} timed out after 600 s"
    elif [ "$status" -ne 0 ]; then
      failed="torch rank ${job#*:} failed (status $status)"
    fi
  done
  running=$still
  [ -z "$failed" ] || { echo "compare_torch.sh: $failed; stopping the other ranks" >&2; exit 1; }
  [ -z "$running" ] || sleep 1
done

/usr/bin/python3 - "$OUT_DIR" <<'PY'
import json, sys
out = sys.argv[1]
ours = json.load(open(f"{out}/bench-ours.json"))
torch = json.load(open(f"{out}/bench-torch.json"))
ratio = torch["hook_ms_max"] / ours["step_ms_max"]
doc = {"ranks": ours["ranks"], "elements": ours["elements"], "ours_step_ms": ours["step_ms_max"],
       "torch_hook_ms": torch["hook_ms_max"], "torch_step_with_hook_ms": torch["step_ms_max"],
       "speedup": ratio}
json.dump(doc, open(f"{out}/bench-compare.json", "w"), indent=2)
print(f"ours {ours['step_ms_max']:.1f} ms/step, torch powerSGD_hook {torch['hook_ms_max']:.1f} ms/step "
      f"-> ours is {ratio:.2f}x faster ({ours['ranks']} ranks, {ours['elements']} elements, rank 2)")
PY
