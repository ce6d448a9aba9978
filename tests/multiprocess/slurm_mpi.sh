#!/usr/bin/env bash
# The example trainer under the launchers users already have, with no MASTER_*
# (nor RANK, WORLD_SIZE, PSGD_*) variables: every run must print the parameters
# hash of `powersgd-run -n 4` with the same arguments (docs/launcher.md, "Slurm
# and MPI").
#   slurm_mpi.sh slurm  SLURM_LOCAL POWERSGD_RUN TRAINER
#     a one-node Slurm (scripts/slurm-local.sh, torn down at the end when this
#     test brought it up): `srun -K -n 4` (reserved ports), an sbatch script
#     with two concurrent 4-task steps (ports derived from job and step ids),
#     a RANK inherited from the batch script (the warning and the error), and
#     rank 0 failing (its port taken) ending the step at once under `srun -K`.
#   slurm_mpi.sh mpirun POWERSGD_RUN TRAINER
#     Open MPI: `mpirun -n 4` on this node (loopback, port from the job id).
# Exit 77 (skipped) without the data set, without root for Slurm, or when the
# packages (slurmctld slurmd slurm-client munge; openmpi-bin) cannot be
# installed. Loopback only: the Slurm node is named localhost; Open MPI is
# limited to lo. Bounded: every command runs under `timeout`.
set -u
mode=${1:?usage: slurm_mpi.sh slurm SLURM_LOCAL POWERSGD_RUN TRAINER | mpirun POWERSGD_RUN TRAINER}
shift
if [ "$mode" = slurm ]; then
  slurm_local=${1:?}
  shift
fi
run=$(realpath "${1:?}")
trainer=$(realpath "${2:?}")
data=/usr/share/datasets/fashion-mnist
[ -f "$data/train-images-idx3-ubyte.gz" ] || { echo "skipped: needs $data (dataset-fashion-mnist)"; exit 77; }
dir=$(mktemp -d /tmp/psgd-slurm-mpi-XXXXXX) || exit 1
chmod 755 "$dir"
brought_up=0
cleanup() {
  [ "$brought_up" -eq 1 ] && "$slurm_local" down
  rm -rf "$dir"
}
trap cleanup EXIT
# Meson's timeout (SIGTERM) and ^C still tear down what this test brought up.
trap 'exit 143' TERM INT HUP

# 256 images, global batch 64 over 4 ranks: 4 steps, compressed from step 1.
args=(--data "$data" --train-limit 256 --test-limit 64 --batch 64 --epochs 1 --rank 2 --start-iter 1 --hidden 32)
# The job's environment: none of the variables that would tell the trainer where the store is.
clean=(env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT -u PSGD_TOKEN
       -u PSGD_RUN_ID -u PSGD_STORE_HOSTED -u PSGD_ADDR -u PSGD_IFACE -u PSGD_STORE_PORT -u PSGD_STORE_ADDR
       PSGD_LOG_LEVEL=info PSGD_TIMEOUT_MS=60000 OPENBLAS_NUM_THREADS=1)

hash_of() { sed -n 's/.*parameters fnv1a64 \([0-9a-f]*\) after 4 steps.*/\1/p' "$1" | head -n 1; }
fail() { echo "FAIL: $1"; shift; for f in "$@"; do echo "--- $f"; cat "$f"; done; exit 1; }
# The run in file $1 printed hash $expected and each of its 4 ranks logged its rendezvous once, containing $2.
check_run() {
  local got
  got=$(hash_of "$1")
  [ "$got" = "$expected" ] || fail "parameters hash '$got', expected $expected (powersgd-run -n 4)" "$1"
  [ "$(grep -c "info: rank [0-3] of 4 .*; rendezvous" "$1")" -eq 4 ] || fail "not one rendezvous line per rank" "$1"
  grep -q "$2" "$1" || fail "no rendezvous line with '$2'" "$1"
}

timeout 120 "${clean[@]}" "$run" -n 4 --timeout 90 -- "$trainer" "${args[@]}" >"$dir/reference" 2>&1 ||
  fail "powersgd-run -n 4" "$dir/reference"
expected=$(hash_of "$dir/reference")
[ -n "$expected" ] || fail "no parameters hash from powersgd-run" "$dir/reference"

if [ "$mode" = mpirun ]; then
  command -v mpirun >/dev/null || {
    if [ "$(id -u)" -eq 0 ]; then
      DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq --no-install-recommends openmpi-bin \
        >/dev/null 2>&1
    fi
    command -v mpirun >/dev/null || { echo "skipped: no mpirun (apt package openmpi-bin)"; exit 77; }
  }
  # As root Open MPI needs --allow-run-as-root; 4 ranks on 2 cores need --oversubscribe.
  mpi=(mpirun --allow-run-as-root --oversubscribe --mca oob_tcp_if_include lo --mca btl self,vader -n 4)
  timeout 120 "${clean[@]}" "${mpi[@]}" "$trainer" "${args[@]}" >"$dir/mpirun" 2>&1 ||
    fail "mpirun -n 4 without MASTER_*" "$dir/mpirun"
  check_run "$dir/mpirun" "(Open MPI); rendezvous 127.0.0.1:[0-9]* (host: loopback (one node.*port: derived from OMPI_MCA_ess_base_jobid="
  echo "PASS: mpirun -n 4 without MASTER_*: parameters $expected, as powersgd-run -n 4"
  exit 0
fi

# ---- Slurm ----
[ "$(id -u)" -eq 0 ] || { echo "skipped: a local Slurm needs root"; exit 77; }
eval "$("$slurm_local" env)"
if ! "$slurm_local" status; then
  brought_up=1
  "$slurm_local" up
  code=$?
  [ "$code" -eq 3 ] && { echo "skipped: cannot bring up a local Slurm (see above)"; exit 77; }
  [ "$code" -eq 0 ] || fail "scripts/slurm-local.sh up exited $code"
fi

# srun: the step's reserved ports (MpiParams=ports in slurm-local.sh's config).
timeout 120 "${clean[@]}" srun -K -n 4 "$trainer" "${args[@]}" >"$dir/srun" 2>&1 || fail "srun -n 4" "$dir/srun"
check_run "$dir/srun" "(Slurm); rendezvous localhost:1[0-9]* (host: first host of SLURM_STEP_NODELIST=localhost; port: first of SLURM_STEP_RESV_PORTS="

# sbatch: two concurrent 4-task steps of one job, ports derived from the job and step ids.
cat >"$dir/job.sh" <<EOF
#!/bin/sh
#SBATCH -n 4
# The token line of docs/launcher.md's job.sh: srun hands it to both steps' tasks.
export PSGD_TOKEN=\$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
srun -K --overlap --resv-ports=0 -n 4 $trainer ${args[*]} >$dir/step-a 2>&1 &
srun -K --overlap --resv-ports=0 -n 4 $trainer ${args[*]} >$dir/step-b 2>&1 &
wait
EOF
job=$(timeout 30 "${clean[@]}" sbatch --parsable -o "$dir/batch.out" -D "$dir" "$dir/job.sh") || fail "sbatch"
# Wait for the job to leave the queue, at most 150 s.
for _ in $(seq 300); do
  [ -z "$(squeue -h -j "$job" 2>/dev/null)" ] && break
  sleep 0.5
done
[ -n "$(squeue -h -j "$job" 2>/dev/null)" ] && { scancel "$job"; fail "sbatch job $job still running after 150 s" "$dir/batch.out"; }
for step in a b; do
  check_run "$dir/step-$step" "(Slurm); rendezvous localhost:[0-9]* (host: first host of SLURM_STEP_NODELIST=localhost; port: derived from SLURM_JOB_ID=$job and SLURM_STEP_ID="
done
port_a=$(sed -n 's/.*rendezvous localhost:\([0-9]*\) .*/\1/p' "$dir/step-a" | head -n 1)
port_b=$(sed -n 's/.*rendezvous localhost:\([0-9]*\) .*/\1/p' "$dir/step-b" | head -n 1)
[ "$port_a" != "$port_b" ] || fail "two steps of one job got the same port $port_a" "$dir/step-a" "$dir/step-b"

# A batch script that exported RANK (every task got RANK=0): the warning, then the error naming the fix.
timeout 60 "${clean[@]}" RANK=0 WORLD_SIZE=4 srun -K -n 4 "$trainer" "${args[@]}" >"$dir/inherited" 2>&1 &&
  fail "srun with an inherited RANK succeeded" "$dir/inherited"
grep -q "warn: RANK=0 differs from SLURM_PROCID=[1-3] while WORLD_SIZE=4 and SLURM_NTASKS=4 agree" "$dir/inherited" ||
  fail "no warning about the inherited RANK" "$dir/inherited"
grep -q "MASTER_ADDR is not set.*a Slurm task (SLURM_PROCID=.*unset RANK and WORLD_SIZE" "$dir/inherited" ||
  fail "the error does not name Slurm and the fix" "$dir/inherited"

# Rank 0 cannot host the store (its port taken): with -K the step ends when rank 0 exits, not after the timeout.
# /usr/bin/python3 holds the port and accepts (the others connect to it and wait).
port_file=$dir/taken-port
timeout 60 /usr/bin/python3 -c "
import socket, sys, time
s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(16)
open(sys.argv[1], 'w').write(str(s.getsockname()[1]))
time.sleep(50)" "$port_file" &
holder=$!
for _ in $(seq 100); do [ -s "$port_file" ] && break; sleep 0.1; done
start=$(date +%s)
timeout 60 "${clean[@]}" MASTER_PORT="$(cat "$port_file")" srun -K -n 4 "$trainer" "${args[@]}" >"$dir/taken" 2>&1 &&
  fail "srun with rank 0's port taken succeeded" "$dir/taken"
elapsed=$(($(date +%s) - start))
kill "$holder" 2>/dev/null
wait "$holder" 2>/dev/null
grep -q "Address already in use\|address already in use\|EADDRINUSE" "$dir/taken" ||
  fail "rank 0 did not report its port in use" "$dir/taken"
[ "$elapsed" -lt 20 ] || fail "srun -K took ${elapsed} s to end the step (PSGD_TIMEOUT_MS=60000)" "$dir/taken"
echo "PASS: srun -n 4 and two concurrent sbatch steps without MASTER_*: parameters $expected, as powersgd-run -n 4;" \
  "ports $port_a and $port_b; inherited RANK warned; srun -K ended a failed step in ${elapsed} s"
