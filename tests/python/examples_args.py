"""The PyTorch examples refuse bad flags (argparse's error: exit 2 naming the flag and the value), and run:

    python3 examples_args.py EXAMPLES/torch_ddp.py EXAMPLES/torch_local_steps.py

Each example runs as one rank of its own job (env://: RANK 0, WORLD_SIZE 1, a free port on loopback) on a tiny
Fashion-MNIST-shaped data set written here (16 training and 8 test images): flags refused while parsing
(--batch-size 0, --lr nan, --epochs 0, --train-limit -5, ...), after loading the shard (a batch larger than it:
no step per epoch; more local steps than an epoch has) and by the wrapper before any collective (--outer-lr
1e39, which float32 does not hold; --start-iter 1 with error feedback); then one short epoch of each example
trains. Exit 0 when all pass, 77 when torch is missing, else 1.
"""
import concurrent.futures
import gzip
import importlib.util
import os
import socket
import struct
import subprocess
import sys
import tempfile


def write_idx(path, shape, data):
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">HBB", 0, 0x08, len(shape)) + struct.pack(">" + "I" * len(shape), *shape) + data)


def tiny_dataset(directory, train=16, test=8):
    for split, count in (("train", train), ("t10k", test)):
        write_idx(os.path.join(directory, "%s-images-idx3-ubyte.gz" % split), (count, 28, 28),
                  bytes((i * 7 + j) % 256 for i in range(count) for j in range(28 * 28)))
        write_idx(os.path.join(directory, "%s-labels-idx1-ubyte.gz" % split), (count,),
                  bytes(i % 10 for i in range(count)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script, flags):
    environment = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    try:
        done = subprocess.run([sys.executable, script] + flags, env=environment, capture_output=True, text=True,
                              timeout=240)
    except subprocess.TimeoutExpired:
        return None, "", "timed out"
    return done.returncode, done.stdout, done.stderr


def main():
    if importlib.util.find_spec("torch") is None:
        print("torch is not installed (Debian: python3-torch): skipped")
        return 77
    ddp, local = sys.argv[1:3]
    with tempfile.TemporaryDirectory(prefix="powersgd-examples-") as data:
        tiny_dataset(data)
        d = ["--data", data]
        # (script, flags, words stderr must hold): refused with exit 2.
        refused = [(ddp, ["--batch-size", "0"], ["--batch-size", "'0'"]),
                   (ddp, ["--batch-size", "-3"], ["--batch-size", "'-3'"]),
                   (ddp, ["--epochs", "0"], ["--epochs", "'0'"]),
                   (ddp, ["--epochs", "-1"], ["--epochs", "'-1'"]),
                   (ddp, ["--lr", "nan"], ["--lr", "'nan'"]),
                   (ddp, ["--lr", "inf"], ["--lr", "'inf'"]),
                   (ddp, ["--lr", "0"], ["--lr", "'0'"]),
                   (ddp, ["--lr", "-0.1"], ["--lr", "'-0.1'"]),
                   (ddp, ["--train-limit", "-5"], ["--train-limit", "'-5'"]),
                   (ddp, ["--threads", "0"], ["--threads", "'0'"]),
                   (ddp, ["--rank", "0"], ["--rank", "'0'"]),
                   (ddp, ["--start-iter", "1"], ["--start-iter", "start_powerSGD_iter = 1"]),
                   (ddp, d + ["--batch-size", "64"], ["--batch-size", "64", "no step"]),
                   (ddp, d + ["--batch-size", "4", "--train-limit", "2"], ["--batch-size", "--train-limit"]),
                   (local, ["--batch-size", "0"], ["--batch-size", "'0'"]),
                   (local, ["--epochs", "0"], ["--epochs", "'0'"]),
                   (local, ["--lr", "nan"], ["--lr", "'nan'"]),
                   (local, ["--local-steps", "0"], ["--local-steps", "'0'"]),
                   (local, ["--outer-lr", "inf"], ["--outer-lr", "'inf'"]),
                   (local, ["--outer-momentum", "1"], ["--outer-momentum", "1.0"]),
                   (local, ["--outer-momentum", "nan"], ["--outer-momentum", "nan"]),
                   (local, ["--train-limit", "-1"], ["--train-limit", "'-1'"]),
                   (local, d + ["--batch-size", "64"], ["--batch-size", "64", "no step"]),
                   (local, d + ["--batch-size", "4", "--local-steps", "5"], ["--local-steps", "5"]),
                   (local, d + ["--batch-size", "4", "--outer-lr", "1e39"], ["--outer-lr", "outer_lr = 1e+39"])]
        failures = []
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda case: run(case[0], case[1]), refused))
        for (script, flags, words), (code, _, stderr) in zip(refused, results):
            name = "%s %s" % (os.path.basename(script), " ".join(f for f in flags if f != data))
            missing = [w for w in words if w not in stderr]
            if code != 2 or missing or "Traceback" in stderr:
                failures.append("%s: exit %s (expected 2), stderr lacks %s:\n%s" % (name, code, missing, stderr))
            else:
                print("%s: refused (%s)" % (name, stderr.strip().splitlines()[-1]))
        # And both train one short epoch on the tiny set.
        for script, flags, words in [(ddp, d + ["--epochs", "1", "--batch-size", "4", "--start-iter", "2"],
                                      "epoch 1: test accuracy"),
                                     (local, d + ["--epochs", "1", "--batch-size", "4", "--local-steps", "2"],
                                      "epoch 1: test accuracy")]:
            code, stdout, stderr = run(script, flags)
            if code != 0 or words not in stdout:
                failures.append("%s: exit %s, stdout %r, stderr:\n%s" % (os.path.basename(script), code, stdout,
                                                                        stderr))
            else:
                print("%s: %s" % (os.path.basename(script), stdout.strip().splitlines()[-1]))
    for failure in failures:
        print("FAIL " + failure)
    print("examples: %s" % ("passed" if not failures else "%d failed" % len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
