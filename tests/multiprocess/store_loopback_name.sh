#!/bin/sh
# Rank 0 hosts the store where MASTER_ADDR resolves: a name for a loopback
# address other than 127.0.0.1 (Debian's hosts file maps the host's own name to
# 127.0.1.1, ip6-localhost to ::1) forms the job (it bound 127.0.0.1 only and
# every rank timed out: "Connection refused"), and a port in use there is an error (not the name's next address).
# Two c_demo ranks per name in a
# network namespace this test creates, whose hosts file (/etc/netns/NS/hosts,
# which `ip netns exec` mounts over /etc/hosts) holds those names; nothing
# leaves it. Needs root (exit 77 otherwise).
#   store_loopback_name.sh C_DEMO
set -u
demo=${1:?usage: store_loopback_name.sh C_DEMO}
[ "$(id -u)" -eq 0 ] || { echo "skipped: needs root (network namespace)"; exit 77; }
command -v ip >/dev/null 2>&1 || { echo "skipped: needs iproute2"; exit 77; }
ns="psgd-lo-$$"
out0=$(mktemp) out1=$(mktemp)
trap 'ip netns delete "$ns" 2>/dev/null; rm -rf "/etc/netns/$ns" "$out0" "$out1"' EXIT
ip netns add "$ns" || exit 1
ip -n "$ns" link set lo up
mkdir -p "/etc/netns/$ns" || exit 1
printf '127.0.0.1 localhost\n127.0.1.1 psgd-master\n::1 localhost ip6-localhost psgd-master6\n' \
  >"/etc/netns/$ns/hosts"
fail=0
for name in psgd-master psgd-master6 localhost 127.0.0.2; do
  ip netns exec "$ns" env -u PSGD_TOKEN RANK=0 WORLD_SIZE=2 MASTER_ADDR="$name" MASTER_PORT=29557 \
    PSGD_TIMEOUT_MS=20000 timeout 60 "$demo" >"$out0" 2>&1 &
  pid0=$!
  ip netns exec "$ns" env -u PSGD_TOKEN RANK=1 WORLD_SIZE=2 MASTER_ADDR="$name" MASTER_PORT=29557 \
    PSGD_TIMEOUT_MS=20000 timeout 60 "$demo" >"$out1" 2>&1
  rc1=$?
  wait "$pid0"
  rc0=$?
  if [ "$rc0" -ne 0 ] || [ "$rc1" -ne 0 ]; then
    echo "FAIL MASTER_ADDR=$name: rank 0 exited $rc0, rank 1 $rc1:"
    cat "$out0" "$out1"
    fail=1
  else
    echo "ok   MASTER_ADDR=$name"
  fi
done
# A second job's rank 0 on the same name and port while the first one's store listens: "Address already in use"
# at once (it bound the name's next address, and its ranks reached the first job's store at the first one).
for name in localhost psgd-master6; do
  ip netns exec "$ns" env -u PSGD_TOKEN RANK=0 WORLD_SIZE=2 MASTER_ADDR="$name" MASTER_PORT=29558 \
    PSGD_TIMEOUT_MS=20000 timeout 60 "$demo" >"$out0" 2>&1 &
  pid0=$!
  # Until its store listens (a loaded machine starts it late; at most 20 s).
  tries=0
  until ip netns exec "$ns" ss -Hltn "sport = :29558" | grep -q LISTEN || [ "$tries" -ge 200 ]; do
    sleep 0.1
    tries=$((tries + 1))
  done
  ip netns exec "$ns" env -u PSGD_TOKEN RANK=0 WORLD_SIZE=2 MASTER_ADDR="$name" MASTER_PORT=29558 \
    PSGD_TIMEOUT_MS=5000 timeout 60 "$demo" >"$out1" 2>&1
  rc1=$?
  kill "$pid0" 2>/dev/null
  wait "$pid0" 2>/dev/null
  if [ "$rc1" -eq 0 ] || ! grep -q "Address already in use" "$out1"; then
    echo "FAIL MASTER_ADDR=$name, the port in use: exited $rc1 (expected 'Address already in use'):"
    cat "$out1"
    fail=1
  else
    echo "ok   MASTER_ADDR=$name, the port in use: refused"
  fi
done
exit "$fail"
