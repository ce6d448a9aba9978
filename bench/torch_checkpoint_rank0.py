"""What a resume from rank 0's checkpoint costs in accuracy (issue 30): the wide perceptron (784-1024-1024-10,
the trainer's `--model wide`) on Fashion-MNIST under DDP with powersgd.torch, checkpointed mid-training and
continued three ways from the same point, in one job:

  own      every rank loads its own state_dict(): the uninterrupted run (bitwise)
  job      every rank loads rank 0's job_state_dict() (collective at saving): the ranks' mean error memory,
           what pickling a PowerSGDState gave before issue 30
  rank0    every rank loads rank 0's state_dict() (local at saving: PyTorch's `if rank == 0: torch.save`):
           warm start and step count, error memory zero

    powersgd-run -n 4 -- /usr/bin/python3 bench/torch_checkpoint_rank0.py [--epochs 2 --save-at-epoch 1 ...]

Rank 0 prints, per continuation, the test accuracy and loss after each epoch and the largest parameter
difference from `own`, and one RESULT line per continuation.
"""
import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from torch_ddp import shards  # noqa: E402  (the example's Fashion-MNIST shards)

from powersgd.torch import PowerSGDState, init_process_group, powerSGD_hook  # noqa: E402


def wide():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


def evaluate(module, test_x, test_y):
    module.eval()
    with torch.no_grad():
        out = module(test_x)
        totals = torch.tensor([float((out.argmax(1) == test_y).sum()), float(F.cross_entropy(out, test_y,
                                                                                            reduction="sum")),
                               float(len(test_y))])
    dist.all_reduce(totals)
    module.train()
    return 100.0 * totals[0].item() / totals[2].item(), totals[1].item() / totals[2].item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-at-epoch", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--start-iter", type=int, default=10)
    parser.add_argument("--train-limit", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train_x, train_y, test_x, test_y, steps = shards(args.data, args.train_limit, args.batch_size)
    options = dict(matrix_approximation_rank=args.rank, start_powerSGD_iter=args.start_iter)

    def epoch_order(epoch):
        return torch.randperm(len(train_x), generator=torch.Generator().manual_seed(1000 * epoch + rank))

    def run_epoch(model, optimizer, epoch):
        order = epoch_order(epoch)
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            F.cross_entropy(model(train_x[batch]), train_y[batch]).backward()
            optimizer.step()

    # Up to the checkpoint.
    torch.manual_seed(0)
    module = wide()
    model = nn.parallel.DistributedDataParallel(module)
    state = PowerSGDState(None, **options)
    model.register_comm_hook(state, powerSGD_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(1, args.save_at_epoch + 1):
        run_epoch(model, optimizer, epoch)
    accuracy, loss = evaluate(module, test_x, test_y)
    if rank == 0:
        print("checkpoint after epoch %d (%d steps of %d images per rank, %d ranks): test accuracy %.2f%%, loss "
              "%.4f" % (args.save_at_epoch, steps * args.save_at_epoch, args.batch_size, world, accuracy, loss),
              flush=True)
    saved_model = copy.deepcopy(module.state_dict())
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    own = state.state_dict()
    job = state.job_state_dict()
    shared = [own]
    dist.broadcast_object_list(shared, src=0)  # rank 0's file, read by every rank
    jobs = [job]
    dist.broadcast_object_list(jobs, src=0)
    state.close()

    finals = {}
    for name, loaded in (("own", own), ("job", jobs[0]), ("rank0", shared[0])):
        module = wide()
        module.load_state_dict(saved_model)
        model = nn.parallel.DistributedDataParallel(module)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        optimizer.load_state_dict(saved_optimizer)
        state = PowerSGDState(None, **options)
        state.load_state_dict(loaded)
        model.register_comm_hook(state, powerSGD_hook)
        for epoch in range(args.save_at_epoch + 1, args.epochs + 1):
            run_epoch(model, optimizer, epoch)
            accuracy, loss = evaluate(module, test_x, test_y)
            if rank == 0:
                print("%-5s (loaded as %s): epoch %d: test accuracy %.2f%%, loss %.4f" % (
                    name, state._resumed_from, epoch, accuracy, loss), flush=True)
        finals[name] = [p.detach().clone() for p in module.parameters()]
        difference = max((a - b).abs().max().item() for a, b in zip(finals[name], finals["own"]))
        if rank == 0:
            print("RESULT %s accuracy %.2f loss %.4f max_param_diff_from_own %.3g" % (name, accuracy, loss,
                                                                                    difference), flush=True)
        state.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
