"""Runs a worker script on 2 local ranks with torchrun's variables only (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, MASTER_PORT; every PSGD_* variable removed): torch's TCPStore on MASTER_PORT, the
engine's store on MASTER_PORT + 1 (docs/torch.md, "Rendezvous"). Debian's torchrun 1.13 itself fails
under Python 3.11 before starting workers, hence this stand-in.

    python3 torchrun_env.py WORKER.py ARGS...

MASTER_PORT is a port below the kernel's ephemeral range (so no outgoing connection can take it or its
successor between the check and the workers' bind) where both it and MASTER_PORT + 1 are free. Exit: the
largest worker exit code; 124 when a worker is still running after 540 s (all are killed).
"""
import os
import random
import socket
import subprocess
import sys


def ephemeral_low():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_pair():
    low = min(ephemeral_low(), 32768)
    candidates = list(range(20000, low - 1))
    random.shuffle(candidates)
    for port in candidates:
        sockets = []
        try:
            for p in (port, port + 1):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no two consecutive free ports below %d" % low)


def main():
    port = free_pair()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSGD_")}
    workers = [subprocess.Popen([sys.executable] + sys.argv[1:],
                                env=dict(env, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
               for r in range(2)]
    codes = []
    try:
        for w in workers:
            codes.append(w.wait(timeout=540))
    except subprocess.TimeoutExpired:
        for w in workers:
            w.kill()
        print("torchrun_env: a worker ran past 540 s; killed", file=sys.stderr)
        return 124
    print("torchrun_env: MASTER_PORT=%d, exit codes %s" % (port, codes))
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
