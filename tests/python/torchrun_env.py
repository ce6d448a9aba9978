"""Runs a worker script on 2 local ranks with torchrun's variables only (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, MASTER_PORT; every PSGD_* variable removed): torch's TCPStore on MASTER_PORT, the
engine's store on MASTER_PORT + 1 (docs/torch.md, "Rendezvous"); or, with --torchrun, through torchrun
itself (`python3 -m torch.distributed.run`, static rendezvous on that MASTER_PORT) with `--redirects 1
--tee 1`: without them Debian's torchrun 1.13 fails under Python 3.11 before starting workers (its
`Std.from_str("0")` is None there, docs/torch.md).

    python3 torchrun_env.py [--torchrun | --busy-next-port | --file-store] WORKER.py ARGS...

--busy-next-port keeps a listening socket on MASTER_PORT + 1 during the run; --file-store gives the workers
no MASTER_ADDR or MASTER_PORT and POWERSGD_TEST_INIT_METHOD=file://... (torch's FileStore) instead.

MASTER_PORT is a port below the kernel's ephemeral range (so no outgoing connection can take it or its
successor between the check and the workers' bind) where both it and MASTER_PORT + 1 are free. Exit: the
largest worker exit code (torchrun's own with --torchrun); 124 when a worker is still running after 540 s
(all are killed).
"""
import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile


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


def run_torchrun(port, env, worker):
    """torchrun with 2 local workers; its session (agent and workers) killed past 540 s."""
    if importlib.util.find_spec("torch") is None:
        print("torch is not installed (Debian: python3-torch): skipped")
        return 77
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
               "127.0.0.1", "--master_port", str(port), "--redirects", "1", "--tee", "1"] + worker
    agent = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        code = agent.wait(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
        print("torchrun_env: torchrun ran past 540 s; killed", file=sys.stderr)
        return 124
    print("torchrun_env: torchrun, MASTER_PORT=%d, exit code %d" % (port, code))
    return code


def main():
    port = free_pair()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSGD_")}
    if sys.argv[1:2] == ["--torchrun"]:
        return run_torchrun(port, env, sys.argv[2:])
    args, busy, directory = sys.argv[1:], None, None
    if args[:1] == ["--busy-next-port"]:
        # Another program listens on MASTER_PORT + 1 (where the engine's own store used to go): the engine
        # must rendezvous through torch's store alone.
        args, busy = args[1:], socket.socket()
        busy.bind(("127.0.0.1", port + 1))
        busy.listen()
    elif args[:1] == ["--file-store"]:
        # torch's FileStore (init_method file://), no MASTER_ADDR or MASTER_PORT at all (ddp_hook.py reads
        # POWERSGD_TEST_INIT_METHOD).
        args, directory = args[1:], tempfile.TemporaryDirectory(prefix="powersgd-filestore-")
        env["POWERSGD_TEST_INIT_METHOD"] = "file://%s/store" % directory.name
    master = {} if directory is not None else dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    workers = [subprocess.Popen([sys.executable] + args,
                                env=dict(env, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                         **master))
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
