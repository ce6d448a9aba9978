"""One rank of a DDP training job of torchvision's ResNet-18 on CPU/Gloo with a chosen comm hook; prints
the outcome and the mean time of a training step (forward, backward with reduction, optimizer).

    powersgd-run -n 4 --timeout 300 -- /usr/bin/python3 bench/torch_ddp_resnet18.py --hook ours
    (PYTHONPATH=BUILD/python for powersgd.torch from a build directory)

--hook: allreduce (DDP's default), torch (PyTorch's powerSGD_hook), torch-batched (PyTorch's
batched_powerSGD_hook), ours (powersgd.torch.powerSGD_hook), ours-batched (its batched_powerSGD_hook). Synthetic CIFAR-sized data (random images and
labels, a fixed seed per rank): the point is the step time and whether the job runs at all.
bench/torch_ddp_hooks.sh runs every hook under a hard timeout and records crashes and hangs.

Rank 0's RESULT line splits the timed steps into forward, backward (which includes DDP's wait for the
last bucket's reduction at its end) and optimizer, and adds compute_s: the mean forward + backward +
optimizer of a step under DDP's no_sync() (no reduction at all) that every rank runs right after each timed
step, so under the same contention for the cores (the host may be shared). reduction_wait_s = step -
compute_s is what the reduction adds to a step. With --hook ours or ours-batched, rank 0 also prints a
BREAKDOWN line: the hook's own timing breakdown of the timed steps (PowerSGDState.timing_breakdown(),
docs/torch.md), in milliseconds per step.
"""
import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

import powersgd.torch as ours
from powersgd import _timing


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hook", choices=["allreduce", "torch", "torch-batched", "ours", "ours-batched"],
                        required=True)
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0)
    parser.add_argument("--first-bucket-mb", type=float, default=None,
                        help="DDP's first (smallest) bucket cap, dist._DEFAULT_FIRST_BUCKET_BYTES (default "
                             "DDP's 1 MB); equal to --bucket-cap-mb and large enough, DDP makes one bucket")
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD matrix_approximation_rank")
    parser.add_argument("--start-iter", type=int, default=3, help="start_powerSGD_iter")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=5, help="steps not timed (includes start_powerSGD_iter)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=32)
    args = parser.parse_args()
    if args.batch_size < 2:
        parser.error("--batch-size %d: ResNet-18's batch norm in training needs at least 2 images per rank"
                     % args.batch_size)
    if args.steps <= args.warmup:
        parser.error("--steps %d must exceed --warmup %d (no step would be timed)" % (args.steps, args.warmup))

    torch.set_num_threads(1)
    ours.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.first_bucket_mb is not None:
        # Read by DistributedDataParallel's constructor (torch 1.13 documents setting it there).
        dist._DEFAULT_FIRST_BUCKET_BYTES = int(args.first_bucket_mb * 1024 * 1024)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(torchvision.models.resnet18(num_classes=10),
                                                bucket_cap_mb=args.bucket_cap_mb)
    if args.hook in ("torch", "torch-batched"):
        state = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank,
                                             start_powerSGD_iter=args.start_iter)
        hook = torch_powersgd.powerSGD_hook if args.hook == "torch" else torch_powersgd.batched_powerSGD_hook
    elif args.hook in ("ours", "ours-batched"):
        state = ours.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank,
                                   start_powerSGD_iter=args.start_iter)
        hook = ours.powerSGD_hook if args.hook == "ours" else ours.batched_powerSGD_hook
    else:
        state, hook = None, None
    if hook is not None:
        model.register_comm_hook(state, hook)

    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator)
    y = torch.randint(0, 10, (args.batch_size,), generator=generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times = {"forward": [], "backward": [], "optimizer": []}

    def step():
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        forward_done = time.perf_counter()
        loss.backward()
        backward_done = time.perf_counter()
        optimizer.step()
        return loss, (forward_done - start, backward_done - forward_done, time.perf_counter() - backward_done)

    compute = []
    for i in range(args.steps):
        if i == args.warmup and args.hook in ("ours", "ours-batched"):
            state.enable_timing()
        loss, parts = step()
        if i >= args.warmup:
            for name, seconds in zip(times, parts):
                times[name].append(seconds)
            with model.no_sync():
                compute.append(sum(step()[1]))
        if rank == 0:
            print("step %d: loss %.4f, %.3f s (forward %.3f, backward %.3f, optimizer %.3f)%s"
                  % (i, loss.item(), sum(parts), *parts,
                     ", compute only %.3f s" % compute[-1] if i >= args.warmup else ""), flush=True)
    # DDP's own record of its buckets (sizes in bytes, comma-separated), after the rebuild where it made one.
    logged = model._get_ddp_logging_data()
    buckets = len((logged.get("rebuilt_bucket_sizes") or logged["bucket_sizes"]).split(","))
    mean = {name: sum(values) / len(values) for name, values in times.items()}
    step_s = sum(mean.values())
    compute_s = sum(compute) / len(compute)
    if rank == 0:
        print("RESULT hook=%s ranks=%d bucket_cap_mb=%g first_bucket_mb=%g buckets=%s batch=%d image=%d "
              "mean_step_s=%.4f forward_s=%.4f backward_s=%.4f optimizer_s=%.4f compute_s=%.4f "
              "reduction_wait_s=%.4f over %d steps"
              % (args.hook, world, args.bucket_cap_mb, dist._DEFAULT_FIRST_BUCKET_BYTES / 1024 / 1024,
                 buckets, args.batch_size, args.image_size, step_s,
                 mean["forward"], mean["backward"], mean["optimizer"], compute_s, step_s - compute_s,
                 len(times["forward"])), flush=True)
        if args.hook in ("ours", "ours-batched"):
            print("BREAKDOWN hook=%s batch=%d %s" % (args.hook, args.batch_size,
                                                     _timing.format_breakdown(state.timing_breakdown())), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
