#!/usr/bin/python3
"""Plot the rank policy's decisions (docs/engine.md, "Rank policy and decision log"): the rank of each bucket
per step from the trainer's --decision-log JSON lines, the learning-rate steps marked, and, given the trainer's
stdout (--train-log), the test accuracy per epoch beside it.

    bench/plot_decisions.py DECISIONS.jsonl OUT.png [--train-log TRAINER.txt] [--steps-per-epoch N]

Needs matplotlib (Debian: python3-matplotlib); without it the script says so and exits 1.
"""
import argparse
import json
import re
import sys


def read_decisions(path):
    entries = [json.loads(line) for line in open(path) if line.strip()]
    for e in entries:
        for key in ("step", "bucket", "rank", "reason", "lr"):
            if key not in e:
                raise SystemExit("%s: an entry without '%s': %s" % (path, key, e))
    return entries


def read_accuracy(path):
    """(epoch, test accuracy %) from the trainer's 'epoch N: ... test accuracy X%' lines."""
    pattern = re.compile(r"epoch (\d+): .*test accuracy ([0-9.]+)%")
    return [(int(m.group(1)), float(m.group(2))) for m in map(pattern.search, open(path)) if m]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("decisions")
    parser.add_argument("out")
    parser.add_argument("--train-log", help="the trainer's stdout, for the accuracy curve")
    parser.add_argument("--steps-per-epoch", type=int, help="places the accuracy of epoch k at step k * N")
    args = parser.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_decisions.py: matplotlib is not installed (Debian: python3-matplotlib)", file=sys.stderr)
        return 1
    entries = read_decisions(args.decisions)
    if not entries:
        raise SystemExit("%s: no decisions" % args.decisions)
    last = max(e["step"] for e in entries) + 1
    accuracy = read_accuracy(args.train_log) if args.train_log else []
    figure, axes = plt.subplots(2 if accuracy else 1, 1, figsize=(9, 6 if accuracy else 3.5), squeeze=False)
    ranks = axes[0][0]
    for bucket in sorted({e["bucket"] for e in entries}):
        mine = sorted((e for e in entries if e["bucket"] == bucket), key=lambda e: e["step"])
        steps = [e["step"] for e in mine] + [last]
        values = [e["rank"] for e in mine] + [mine[-1]["rank"]]
        ranks.step(steps, values, where="post", label="bucket %d" % bucket)
    # Learning-rate steps: where the lr of consecutive entries changes, and every lr_note decision.
    previous = None
    for e in sorted(entries, key=lambda e: e["step"]):
        if previous is not None and e["lr"] != previous:
            ranks.axvline(e["step"], color="grey", linestyle="--", linewidth=0.8)
        previous = e["lr"]
    for step in sorted({e["step"] for e in entries if e["reason"] == "lr_note"}):
        ranks.axvline(step, color="red", linestyle=":", linewidth=0.8)
    ranks.set_xlabel("step (dashed: learning rate changed; dotted red: lr_note)")
    ranks.set_ylabel("rank")
    ranks.legend(loc="upper right")
    if accuracy:
        curve = axes[1][0]
        x = [epoch * args.steps_per_epoch if args.steps_per_epoch else epoch for epoch, _ in accuracy]
        curve.plot(x, [a for _, a in accuracy], marker="o")
        curve.set_xlabel("step" if args.steps_per_epoch else "epoch")
        curve.set_ylabel("test accuracy (%)")
    figure.tight_layout()
    figure.savefig(args.out)
    print("plot_decisions.py: %d decisions of %d buckets -> %s" % (len(entries), len({e["bucket"] for e in entries}),
                                                                 args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
