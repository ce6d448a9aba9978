#!/usr/bin/env bash
# A one-node Slurm on this machine, from Debian's packages, without systemd:
# munged, slurmctld and slurmd for one node named "localhost" (so every job's
# node list is loopback), with 4 task slots at least (SlurmdParameters=
# config_overrides lets 4 tasks share 2 cores). For the multiprocess tests
# (tests/multiprocess/slurm_mpi.sh) and for trying srun/sbatch by hand.
#   scripts/slurm-local.sh up     install what is missing (apt-get), start what is not running; idempotent
#   scripts/slurm-local.sh down   stop what `up` started (its own daemons only)
#   scripts/slurm-local.sh status exit 0 when this script's daemons run and the node is up
#   scripts/slurm-local.sh env    print the `export SLURM_CONF=...` line the clients need
# Needs root (the daemons run as root; munged as the munge user). Exit 3 when
# Slurm cannot be had here (not root, the packages cannot be installed, another
# Slurm runs here: the tests then skip), 1 when a daemon fails to start.
# Everything lives in $PSGD_SLURM_DIR (default /run/powersgd-slurm): config, logs,
# state, pid files. The clients find the config through SLURM_CONF, so a
# machine's own /etc/slurm is neither read nor changed; the script refuses to
# start when another slurmctld or slurmd already runs here.
set -uo pipefail

dir=${PSGD_SLURM_DIR:-/run/powersgd-slurm}
conf=$dir/slurm.conf
export SLURM_CONF=$conf
packages=(slurmctld slurmd slurm-client munge)

cannot() { echo "slurm-local: $*" >&2; exit 3; }
fail() { echo "slurm-local: $*" >&2; exit 1; }

alive() {  # pid file
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_missing() {
  local missing=() p
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || cannot "needs root to install ${missing[*]}"
  echo "slurm-local: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  timeout 300 apt-get update -qq >/dev/null 2>&1
  timeout 300 apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
    cannot "apt-get install ${missing[*]} failed"
}

write_conf() {
  local cpus
  cpus=$(nproc)
  [ "$cpus" -ge 4 ] || cpus=4
  cat >"$conf.new" <<EOF
# Written by scripts/slurm-local.sh: one node, no cgroups, no accounting.
ClusterName=powersgd
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MpiParams=ports=12000-12999
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdParameters=config_overrides
InactiveLimit=0
KillWait=2
MinJobAge=5
NodeName=localhost CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES OverSubscribe=YES MaxTime=INFINITE State=UP
EOF
  mv "$conf.new" "$conf"
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
  [ -f /etc/munge/munge.key ] || fail "no /etc/munge/munge.key (the munge package creates it)"
  mkdir -p /run/munge && chown munge:munge /run/munge && chmod 0755 /run/munge
  # munged refuses to run as root with its log owned by munge: run it as munge.
  runuser -u munge -- /usr/sbin/munged || fail "munged did not start"
  cp /run/munge/munged.pid "$dir/munged.pid" 2>/dev/null
  for _ in $(seq 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  fail "munged does not answer (munge -n | unmunge)"
}

up() {
  [ "$(id -u)" -eq 0 ] || cannot "needs root (the daemons run as root)"
  install_missing
  mkdir -p "$dir/state" "$dir/spool" || fail "cannot create $dir"
  if ! alive "$dir/slurmctld.pid" && pgrep -x slurmctld >/dev/null; then cannot "another slurmctld runs here"; fi
  if ! alive "$dir/slurmd.pid" && pgrep -x slurmd >/dev/null; then cannot "another slurmd runs here"; fi
  start_munge
  if ! alive "$dir/slurmctld.pid" || ! alive "$dir/slurmd.pid"; then
    # A changed node line needs both daemons restarted: start them together.
    down_daemons
    write_conf
    mkdir -p /run/slurm
    /usr/sbin/slurmctld -i -f "$conf" || fail "slurmctld did not start: $(tail -3 "$dir/slurmctld.log" 2>/dev/null)"
    # -N localhost: the node is named localhost whatever this machine's hostname.
    /usr/sbin/slurmd -N localhost -f "$conf" || fail "slurmd did not start: $(tail -3 "$dir/slurmd.log" 2>/dev/null)"
  fi
  for _ in $(seq 100); do
    node_up && return 0
    sleep 0.1
  done
  fail "node localhost is not up after 10 s (state '$(node_state)'): $(tail -3 "$dir/slurmd.log" 2>/dev/null)"
}

node_state() { timeout 5 sinfo -h -n localhost -o %t 2>/dev/null; }
node_up() {
  case $(node_state) in
    idle | mix | alloc) return 0 ;;
  esac
  return 1
}

stop() {  # pid file: TERM, then KILL after 5 s
  alive "$1" || { rm -f "$1"; return 0; }
  local pid
  pid=$(cat "$1")
  kill "$pid" 2>/dev/null
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$1"; return 0; }
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null
  rm -f "$1"
}

down_daemons() {
  if alive "$dir/slurmctld.pid"; then scancel --quiet --user=root 2>/dev/null; fi
  stop "$dir/slurmd.pid"
  stop "$dir/slurmctld.pid"
}

down() {
  down_daemons
  stop "$dir/munged.pid"
}

case ${1:-} in
  up) up ;;
  down) down ;;
  status) alive "$dir/slurmctld.pid" && alive "$dir/slurmd.pid" && node_up ;;
  env) echo "export SLURM_CONF=$conf" ;;
  *) fail "usage: slurm-local.sh up|down|env" ;;
esac
