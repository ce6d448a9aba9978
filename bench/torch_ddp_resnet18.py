"""One rank of a DDP training job of torchvision's ResNet-18 on CPU/Gloo with a chosen comm hook; prints
the outcome and the mean time of a training step (forward, backward with reduction, optimizer).

    powersgd-run -n 4 --timeout 300 -- /usr/bin/python3 bench/torch_ddp_resnet18.py --hook ours
    (PYTHONPATH=BUILD/python for powersgd.torch from a build directory)

--hook: allreduce (DDP's default), torch (PyTorch's powerSGD_hook), torch-batched (PyTorch's
batched_powerSGD_hook), ours (powersgd.torch.powerSGD_hook), ours-batched (its batched_powerSGD_hook). Synthetic CIFAR-sized data (random images and
labels, a fixed seed per rank): the point is the step time and whether the job runs at all.
bench/torch_ddp_hooks.sh runs every hook under a hard timeout and records crashes and hangs.
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hook", choices=["allreduce", "torch", "torch-batched", "ours", "ours-batched"],
                        required=True)
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0)
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD matrix_approximation_rank")
    parser.add_argument("--start-iter", type=int, default=3, help="start_powerSGD_iter")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=5, help="steps not timed (includes start_powerSGD_iter)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=32)
    args = parser.parse_args()

    torch.set_num_threads(1)
    ours.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(torchvision.models.resnet18(num_classes=10),
                                                bucket_cap_mb=args.bucket_cap_mb)
    buckets = set()
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
        def counting(s, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            buckets.add(bucket.index())
            return hook(s, bucket)
        model.register_comm_hook(state, counting)

    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator)
    y = torch.randint(0, 10, (args.batch_size,), generator=generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        if rank == 0:
            print("step %d: loss %.4f, %.3f s" % (step, loss.item(), times[-1]), flush=True)
    timed = times[args.warmup:] or times
    if rank == 0:
        print("RESULT hook=%s ranks=%d bucket_cap_mb=%g buckets=%s mean_step_s=%.4f over %d steps"
              % (args.hook, world, args.bucket_cap_mb, len(buckets) if buckets else "n/a",
                 sum(timed) / len(timed), len(timed)), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
