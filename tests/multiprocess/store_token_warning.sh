#!/bin/sh
# Rank 0's own store (no launcher) on a non-loopback MASTER_ADDR without
# PSGD_TOKEN logs one warning naming PSGD_TOKEN, and the job still runs; with a
# token, or on loopback, it logs none. In a job of two (as srun or mpirun start
# it, with no launcher to make a token) each rank logs one such warning. The non-loopback address lives in a
# network namespace this test creates (a veth pair inside it, 10.99.0.1) and
# removes; nothing leaves it. Needs root (exit 77 otherwise).
#   store_token_warning.sh C_DEMO
set -u
demo=${1:?usage: store_token_warning.sh C_DEMO}
[ "$(id -u)" -eq 0 ] || { echo "skipped: needs root (network namespace)"; exit 77; }
command -v ip >/dev/null 2>&1 || { echo "skipped: needs iproute2"; exit 77; }
ns="psgd-warn-$$"
out=$(mktemp) out1=$(mktemp)
trap 'ip netns delete "$ns" 2>/dev/null; rm -f "$out" "$out1"' EXIT
ip netns add "$ns" || exit 1
ip -n "$ns" link set lo up
ip -n "$ns" link add psgd0 type veth peer name psgd1
ip -n "$ns" addr add 10.99.0.1/24 dev psgd0
ip -n "$ns" link set psgd1 up
ip -n "$ns" link set psgd0 up

fail=0
run() {  # label, expect_warning (0/1), env assignments...
  label=$1 expect=$2
  shift 2
  if ! ip netns exec "$ns" env -u PSGD_TOKEN RANK=0 WORLD_SIZE=1 MASTER_PORT=29555 "$@" timeout 60 "$demo" >"$out" 2>&1; then
    echo "FAIL $label: c_demo failed:"; cat "$out"; fail=1; return
  fi
  warnings=$(grep -c "PSGD_TOKEN" "$out")
  if [ "$expect" = 1 ] && [ "$warnings" -ne 1 ]; then
    echo "FAIL $label: expected one warning naming PSGD_TOKEN, got $warnings:"; cat "$out"; fail=1; return
  fi
  if [ "$expect" = 0 ] && [ "$warnings" -ne 0 ]; then
    echo "FAIL $label: expected no warning, got:"; cat "$out"; fail=1; return
  fi
  echo "ok   $label"
}
# Two ranks in the namespace: rank 0 hosts the store, rank 1 is its client; each
# must warn once (without a token) or never (with one).
run_pair() {  # label, expect_warning (0/1), env assignments...
  label=$1 expect=$2
  shift 2
  ip netns exec "$ns" env -u PSGD_TOKEN RANK=0 WORLD_SIZE=2 MASTER_ADDR=10.99.0.1 MASTER_PORT=29556 \
    PSGD_TIMEOUT_MS=30000 "$@" timeout 60 "$demo" >"$out" 2>&1 &
  pid0=$!
  ip netns exec "$ns" env -u PSGD_TOKEN RANK=1 WORLD_SIZE=2 MASTER_ADDR=10.99.0.1 MASTER_PORT=29556 \
    PSGD_TIMEOUT_MS=30000 "$@" timeout 60 "$demo" >"$out1" 2>&1
  rc1=$?
  wait "$pid0"
  rc0=$?
  if [ "$rc0" -ne 0 ] || [ "$rc1" -ne 0 ]; then
    echo "FAIL $label: c_demo failed (rank 0: $rc0, rank 1: $rc1):"; cat "$out" "$out1"; fail=1; return
  fi
  for f in "$out" "$out1"; do
    warnings=$(grep -c "PSGD_TOKEN" "$f")
    if [ "$warnings" -ne "$expect" ]; then
      echo "FAIL $label: expected $expect warning(s) naming PSGD_TOKEN per rank, got $warnings:"; cat "$f"; fail=1
      return
    fi
  done
  echo "ok   $label"
}
run "non-loopback MASTER_ADDR, no token" 1 MASTER_ADDR=10.99.0.1
run "non-loopback MASTER_ADDR, token set" 0 MASTER_ADDR=10.99.0.1 PSGD_TOKEN=s3cret
run "loopback MASTER_ADDR, no token" 0 MASTER_ADDR=127.0.0.1
run_pair "two ranks, non-loopback MASTER_ADDR, no token: rank 0 and rank 1 warn" 1
run_pair "two ranks, non-loopback MASTER_ADDR, token set: neither warns" 0 PSGD_TOKEN=s3cret
exit $fail
