"""A complete CPU training job with PyTorch DDP and powersgd's comm hook: a small CNN on Fashion-MNIST.

    powersgd-run -n 4 -- /usr/bin/python3 examples/torch_ddp.py            # PYTHONPATH=BUILD/python if not installed
    torchrun --nproc_per_node 4 --redirects 1 --tee 1 examples/torch_ddp.py  # the last two for torch 1.13 on
                                                                           # Python 3.11 (docs/torch.md)

Data: Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist, or --data DIR). Each rank trains on
its shard of the 60000 training images and evaluates its shard of the 10000 test images; rank 0 prints, per
epoch, the test accuracy, the mean training loss, and the bytes this rank passed to gradient collectives.
--hook allreduce runs the same job with DDP's default averaged allreduce (for comparison).
"""
import argparse
import gzip
import math
import os
import struct
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from powersgd.torch import PowerSGDState, init_process_group, powerSGD_hook


def read_idx(path):
    """An IDX file (the MNIST format) as a uint8 tensor."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError("%s: not an IDX file of unsigned bytes" % path)
    shape = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).reshape(shape)


def load(directory, split):
    images = read_idx(os.path.join(directory, "%s-images-idx3-ubyte.gz" % split))
    labels = read_idx(os.path.join(directory, "%s-labels-idx1-ubyte.gz" % split))
    # Scaled to [0, 1] and normalized with Fashion-MNIST's mean and standard deviation.
    return ((images.float() / 255.0 - 0.2860) / 0.3530).unsqueeze(1), labels.long()


def shards(directory, train_limit, batch_size):
    """This rank's shard of the training and test images (every world-th from its rank on), and the steps
    per epoch of batch_size images, the same on every rank (collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    train_x, train_y = load(directory, "train")
    test_x, test_y = load(directory, "t10k")
    if train_limit:
        train_x, train_y = train_x[:train_limit], train_y[:train_limit]
    train_x, train_y = train_x[rank::world], train_y[rank::world]
    test_x, test_y = test_x[rank::world], test_y[rank::world]
    steps = torch.tensor([len(train_x) // batch_size])  # equal on every rank up to one batch: the minimum
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    return train_x, train_y, test_x, test_y, int(steps.item())


def integer_at_least(low):
    """An argparse type: an integer >= low (a bad value: exit 2 naming the flag and the value)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError("expected an integer >= %d, got %r" % (low, text))
        return value
    parse.__name__ = "integer >= %d" % low
    return parse


def positive_number(text):
    """An argparse type: a finite number > 0 (a learning rate)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError("expected a finite number > 0, got %r" % (text,))
    return value


def no_empty_epoch(parser, steps, args, world):
    """Exit 2 (parser.error) where an epoch would have no step: --batch-size more than a rank's shard."""
    if steps < 1:
        parser.error("argument --batch-size: %d is more than the training images of a rank's shard (%s over %d "
                     "ranks): an epoch would have no step" % (args.batch_size, "%d images (--train-limit)"
                                                              % args.train_limit if args.train_limit else
                                                              "the training set", world))


def wrapper_error(parser, error, flags):
    """Exit 2 (parser.error) for a TypeError or ValueError of powersgd's constructors, which name the argument:
    named here as the flag that gave it (`flags`: argument name -> flag)."""
    named = [flag for name, flag in flags.items() if name + " = " in str(error)]
    parser.error("argument %s: %s" % (named[0] if named else "/".join(flags.values()), error))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class CountingAllreduce:
    """DDP's default averaged allreduce, counting the bytes it passes to the collective."""

    def __init__(self):
        self.bytes = 0

    def bytes_sent(self):
        return self.bytes


def counting_allreduce_hook(state: CountingAllreduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(None, bucket)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--epochs", type=integer_at_least(1), default=3)
    parser.add_argument("--batch-size", type=integer_at_least(1), default=64, help="per rank")
    parser.add_argument("--lr", type=positive_number, default=0.05)
    parser.add_argument("--hook", choices=["powersgd", "allreduce"], default="powersgd")
    parser.add_argument("--rank", type=integer_at_least(1), default=2, help="PowerSGD matrix_approximation_rank")
    parser.add_argument("--start-iter", type=integer_at_least(0), default=10, help="PowerSGD start_powerSGD_iter")
    parser.add_argument("--train-limit", type=integer_at_least(0), default=0,
                        help="use only the first N training images (0: all)")
    parser.add_argument("--threads", type=integer_at_least(1), default=1, help="torch intra-op threads per rank")
    args = parser.parse_args()
    if args.hook == "powersgd":
        try:  # the hook's own checks (no collective): e.g. --start-iter 1 with error feedback, --rank 65
            state = PowerSGDState(process_group=None, matrix_approximation_rank=args.rank,
                                  start_powerSGD_iter=args.start_iter)
        except (TypeError, ValueError) as e:
            wrapper_error(parser, e, {"matrix_approximation_rank": "--rank", "start_powerSGD_iter": "--start-iter"})

    torch.set_num_threads(args.threads)
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    train_x, train_y, test_x, test_y, steps = shards(args.data, args.train_limit, args.batch_size)
    no_empty_epoch(parser, steps, args, world)  # the same on every rank: steps is their minimum

    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.parallel.DistributedDataParallel(SmallCNN())
    if args.hook == "powersgd":
        model.register_comm_hook(state, powerSGD_hook)
    else:
        state = CountingAllreduce()
        model.register_comm_hook(state, counting_allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    generator = torch.Generator().manual_seed(1000 + rank)

    if rank == 0:
        print("torch_ddp: %d ranks, %s hook%s, %d steps of %d images per rank per epoch"
              % (world, args.hook, " (rank %d, from step %d)" % (args.rank, args.start_iter)
                 if args.hook == "powersgd" else "", steps, args.batch_size), flush=True)
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(train_x), generator=generator)
        sent_before = state.bytes_sent()
        start = time.perf_counter()
        loss_sum = torch.zeros(1)
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(train_x[batch]), train_y[batch])
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
        seconds = time.perf_counter() - start
        sent = state.bytes_sent() - sent_before

        model.eval()
        with torch.no_grad():
            correct = (model.module(test_x).argmax(1) == test_y).sum()
        totals = torch.tensor([float(correct), float(len(test_y)), float(loss_sum), float(steps)])
        dist.all_reduce(totals)
        if rank == 0:
            print("epoch %d: test accuracy %.2f%%, train loss %.4f, %.1f MB sent by rank 0 for gradients, %.1f s"
                  % (epoch, 100.0 * totals[0] / totals[1], totals[2] / totals[3], sent / 1e6, seconds), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
