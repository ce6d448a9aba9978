"""Local steps with a compressed outer step in PyTorch, without DDP (powersgd.torch.LocalSteps): an MLP on
Fashion-MNIST.

    powersgd-run -n 4 -- /usr/bin/python3 examples/torch_local_steps.py --local-steps 4   # PYTHONPATH=BUILD/python

Each rank trains its shard with its own SGD with momentum (no communication) and every --local-steps inner
steps one outer step averages the ranks' pseudo-gradients with PowerSGD (--rank; --no-compression: a plain
averaged allreduce) and applies them from the synchronised start point (--outer-lr, --outer-momentum). Each
epoch has a multiple of --local-steps steps, so it ends on an outer step; rank 0 prints the synchronised
model's test accuracy (the full test set, in shards) and the bytes rank 0 passed to the outer steps' collectives.
Data: examples/torch_ddp.py's (Debian's dataset-fashion-mnist, or --data DIR).
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_ddp import integer_at_least, no_empty_epoch, positive_number, shards, wrapper_error  # noqa: E402

from powersgd.torch import LocalSteps, init_process_group  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--epochs", type=integer_at_least(1), default=2)
    parser.add_argument("--batch-size", type=integer_at_least(1), default=64, help="per rank")
    parser.add_argument("--lr", type=positive_number, default=0.05, help="inner SGD learning rate (momentum 0.9)")
    parser.add_argument("--local-steps", type=integer_at_least(1), default=4, help="inner steps per outer step")
    parser.add_argument("--outer-lr", type=positive_number, default=1.0)
    parser.add_argument("--outer-momentum", type=float, default=0.0, help="0 <= momentum < 1")
    parser.add_argument("--rank", type=integer_at_least(1), default=4, help="PowerSGD matrix_approximation_rank")
    parser.add_argument("--start-iter", type=integer_at_least(0), default=0,
                        help="uncompressed outer steps before PowerSGD")
    parser.add_argument("--no-compression", action="store_true")
    parser.add_argument("--train-limit", type=integer_at_least(0), default=0,
                        help="use only the first N training images (0: all)")
    args = parser.parse_args()
    if not 0 <= args.outer_momentum < 1:  # also nan
        parser.error("argument --outer-momentum: expected 0 <= momentum < 1, got %r" % args.outer_momentum)

    torch.set_num_threads(1)
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train_x, train_y, test_x, test_y, steps = shards(args.data, args.train_limit, args.batch_size)
    no_empty_epoch(parser, steps, args, world)  # the same on every rank: steps is their minimum
    if steps < args.local_steps:
        parser.error("argument --local-steps: %d is more than the %d steps of an epoch (--batch-size %d): nothing "
                     "would be trained" % (args.local_steps, steps, args.batch_size))
    steps -= steps % args.local_steps  # each epoch ends on an outer step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    try:  # LocalSteps checks its arguments before any collective, alike on every rank (the engine's ranges)
        outer = LocalSteps(model, optimizer, local_steps=args.local_steps, outer_lr=args.outer_lr,
                           outer_momentum=args.outer_momentum, matrix_approximation_rank=args.rank,
                           start_powerSGD_iter=args.start_iter, compression=not args.no_compression)
    except (TypeError, ValueError) as e:
        wrapper_error(parser, e, {"local_steps": "--local-steps", "outer_lr": "--outer-lr",
                                  "outer_momentum": "--outer-momentum", "matrix_approximation_rank": "--rank",
                                  "start_powerSGD_iter": "--start-iter"})
    generator = torch.Generator().manual_seed(1000 + rank)
    if rank == 0:
        print("torch_local_steps: %d ranks, H = %d, %s, outer lr %g momentum %g, %d steps of %d images per rank "
              "per epoch" % (world, args.local_steps, "uncompressed" if args.no_compression else "rank %d" % args.rank,
                             args.outer_lr, args.outer_momentum, steps, args.batch_size), flush=True)
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(train_x), generator=generator)
        sent_before, start = outer.bytes_sent(), time.perf_counter()
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            outer.zero_grad()
            F.cross_entropy(model(train_x[batch]), train_y[batch]).backward()
            outer.step()
        with torch.no_grad():
            correct = (model(test_x).argmax(1) == test_y).sum()
        totals = torch.tensor([float(correct), float(len(test_y))])
        dist.all_reduce(totals)
        if rank == 0:
            print("epoch %d: test accuracy %.2f%%, %d outer steps, %d bytes sent by rank 0 in the epoch, %.1f s"
                  % (epoch, 100.0 * totals[0] / totals[1], outer.outer_steps, outer.bytes_sent() - sent_before,
                     time.perf_counter() - start), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
