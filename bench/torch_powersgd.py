#!/usr/bin/python3
"""PyTorch's PowerSGD DDP hook on a model's parameter shapes, for comparison
with powersgd-bench engine (bench/compare_torch.sh runs both).

Every rank runs this script with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
set (torch.distributed env:// rendezvous, gloo backend, CPU). The model is a
list of parameters with the shapes of data/models/*.shapes; the loss
sum(p * g) makes every step's gradient a fixed random tensor g. DDP puts all
gradients in ONE bucket (more than one crashes or hangs the hook with gloo in
torch 1.13). The hook's time per step is the step time with powerSGD_hook
minus the step time with a hook that returns the bucket unchanged (same
forward/backward, no communication). Rank 0 writes the JSON."""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel


def read_shapes(path):
    shapes = []
    with open(path) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                shapes.append([int(d) for d in line.split()[1:]])
    return shapes


class Model(torch.nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])

    def forward(self, grads):
        return sum((p * g).sum() for p, g in zip(self.params, grads))


def noop_hook(state, bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def time_steps(model, grads, steps, warmup, buckets_seen):
    times = []
    for step in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        model(grads).backward()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", required=True)
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD matrix approximation rank")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    torch.set_num_threads(int(os.environ.get("TORCH_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = read_shapes(args.shapes)
    generator = torch.Generator().manual_seed(rank + 1)
    grads = [torch.randn(s, generator=generator) for s in shapes]

    # One bucket: DDP otherwise makes a small first bucket (1 MiB) besides bucket_cap_mb.
    dist._DEFAULT_FIRST_BUCKET_BYTES = 1 << 40
    results = {}
    for name in ("noop", "powersgd"):
        buckets_seen = set()
        ddp = DistributedDataParallel(Model(shapes), bucket_cap_mb=1 << 20)
        if name == "noop":
            hook, state = noop_hook, None
        else:
            # start_powerSGD_iter must be > 1 with error feedback / warm start (DDP rebuilds buckets at step 1);
            # the warm-up steps cover the uncompressed ones.
            state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank,
                                           start_powerSGD_iter=2, min_compression_rate=2,
                                           use_error_feedback=True, warm_start=True, random_seed=0)
            hook = powersgd.powerSGD_hook

        def counting_hook(s, bucket, hook=hook, seen=buckets_seen):
            seen.add(bucket.index())
            return hook(s, bucket)

        ddp.register_comm_hook(state, counting_hook)
        results[name] = time_steps(ddp, grads, args.steps, max(args.warmup, 3), buckets_seen)
        if len(buckets_seen) != 1:
            raise SystemExit(f"torch_powersgd.py: DDP used {len(buckets_seen)} buckets, expected 1")
        del ddp

    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"noop_ms": results["noop"] * 1e3, "powersgd_ms": results["powersgd"] * 1e3})
    if rank == 0:
        hook_ms = max(r["powersgd_ms"] - r["noop_ms"] for r in per_rank)
        doc = {"benchmark": "torch_powersgd_hook", "torch": torch.__version__, "ranks": world,
               "elements": sum(g.numel() for g in grads), "rank": args.rank, "steps": args.steps,
               "per_rank": per_rank, "hook_ms_max": hook_ms,
               "step_ms_max": max(r["powersgd_ms"] for r in per_rank)}
        print(f"torch {torch.__version__} powerSGD_hook, {world} ranks, rank {args.rank}: step with hook "
              f"{doc['step_ms_max']:.1f} ms, hook alone {hook_ms:.1f} ms (slowest rank, median of {args.steps})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
