#!/usr/bin/python3
"""Plots bench/torch_ddp_hooks.sh RESULTS_TSV output: DDP training-step time of each comm hook
configuration per batch size, split into compute only and the reduction's addition; a job that crashed or
hung is marked where its bar would be.

    bench/plot_torch_ddp.py [--setting TEXT] OUT.png RUN.tsv [RUN.tsv ...]

Every row is one run (job) of a configuration and batch size: several files (several invocations) and
ROUNDS > 1 (several rows in one file) are pooled. The bar is the median of the runs' mean steps (pale: their
median compute only), a dot each run. --setting names where the runs ran in the title, e.g. "4 emulated
hosts, 1 Gbit/s links" (the TSV does not record LAUNCH_ARGS); without it the title claims none.
Needs Debian's python3-matplotlib.
"""
import argparse
import csv
import statistics
import sys

COLUMNS = ("hook", "bucket_cap", "batch", "image", "outcome", "buckets", "step_s", "compute_s")
NAMES = {"allreduce": "DDP allreduce", "torch": "PyTorch powerSGD_hook", "torch-batched":
         "PyTorch batched_powerSGD_hook", "ours": "powersgd.torch", "ours-batched": "powersgd.torch batched"}


def read_runs(paths):
    """{(batch, image): {config: [row per run]}} with configs in first-seen order."""
    groups, configs = {}, []
    for path in paths:
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f, delimiter="\t")
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise ValueError("%s: not bench/torch_ddp_hooks.sh RESULTS_TSV output (no column %s)"
                                 % (path, ", ".join(missing)))
            for row in reader:
                config = (row["hook"], row["bucket_cap"])
                if config not in configs:
                    configs.append(config)
                groups.setdefault((int(row["batch"]), int(row["image"])), {}).setdefault(config, []).append(row)
    return groups, configs


def label(config, rows):
    hook, cap = config
    buckets = {r["buckets"] for r in rows if r["buckets"]}
    where = "1 bucket" if cap == "one" else "cap %s MB" % cap
    if buckets and cap != "one":
        where += ", %s buckets" % "/".join(sorted(buckets))
    return "%s (%s)" % (NAMES.get(hook, hook), where)


def main(argv):
    parser = argparse.ArgumentParser(prog="bench/plot_torch_ddp.py", description=__doc__.splitlines()[0])
    parser.add_argument("--setting", help='where the runs ran, for the title, e.g. "4 emulated hosts, 1 Gbit/s links"')
    parser.add_argument("out", metavar="OUT.png")
    parser.add_argument("runs", metavar="RUN.tsv", nargs="+")
    args = parser.parse_args(argv[1:])
    try:
        groups, configs = read_runs(args.runs)
    except (OSError, ValueError) as error:
        print("plot_torch_ddp.py: %s" % error, file=sys.stderr)
        return 2
    if not groups:
        print("plot_torch_ddp.py: no rows in %s" % ", ".join(args.runs), file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt

    rank_of = {}
    keys = sorted(groups, key=lambda k: -k[0])
    width = 0.8 / len(configs)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(8.0, 4.6), dpi=100)
    top = max(float(r["step_s"]) for g in groups.values() for rows in g.values() for r in rows if r["step_s"])
    for i, config in enumerate(configs):
        rows_all = [r for g in groups.values() for r in g.get(config, [])]
        name = label(config, rows_all)
        rank_of[name] = rank_of[name + ": no step"] = i
        for j, key in enumerate(keys):
            rows = groups[key].get(config, [])
            x = j + (i - (len(configs) - 1) / 2) * width
            done = [r for r in rows if r["step_s"]]
            if not done:
                if rows:
                    what = "hangs" if rows[0]["outcome"].startswith("hangs") else "crashes"
                    ax.text(x, top * 0.02, what, rotation=90, ha="center", va="bottom", fontsize=8,
                            color=colors[i % len(colors)])
                continue
            # Medians, as bench/torch_ddp_hooks.sh's ROUNDS summary and the docs' tables.
            step = statistics.median(float(r["step_s"]) for r in done)
            compute = min(statistics.median(float(r["compute_s"]) for r in done), step)
            ax.bar(x, compute, width, color=colors[i % len(colors)], alpha=0.45)
            ax.bar(x, step - compute, width, bottom=compute, color=colors[i % len(colors)], label=name)
            name = None  # one legend entry per configuration
            ax.plot([x] * len(done), [float(r["step_s"]) for r in done], "k.", markersize=4)
            ax.annotate("%.2f" % step, (x, step), textcoords="offset points", xytext=(0, 3), ha="center",
                        fontsize=7)
        if name is not None:  # never trained: a legend entry all the same
            ax.add_patch(matplotlib.patches.Rectangle((0, 0), 0, 0, color=colors[i % len(colors)],
                                                      label=name + ": no step"))
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(["%d images of %dx%d per rank" % (b, s, s) for b, s in keys])
    ax.set_ylabel("training step (s), median of the runs\npale: compute only (no_sync), solid: reduction")
    ax.set_ylim(0, top * 1.4)  # room for the legend
    ax.set_xlim(-0.5, len(keys) - 0.5)
    ax.grid(True, axis="y", alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    order = sorted(range(len(names)), key=lambda k: rank_of[names[k]])  # configurations in run order
    ax.legend([handles[k] for k in order], [names[k] for k in order], fontsize=8, loc="upper center", ncol=2)
    loads = [float(r["loadavg"]) for g in groups.values() for rows in g.values() for r in rows if r.get("loadavg")]
    # Runs per bar: the rows of each configuration and batch size (every file's rounds), not the files.
    runs = sorted({len(rows) for g in groups.values() for rows in g.values()})
    count = "%d" % runs[0] if len(runs) == 1 else "%d-%d" % (runs[0], runs[-1])
    ax.set_title("ResNet-18, DDP%s (%s run%s each%s)"
                 % (" on " + args.setting if args.setting else "", count, "" if runs[-1] == 1 else "s",
                    ", host load average %.0f-%.0f" % (min(loads), max(loads)) if loads else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out)
    print("wrote %s" % args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
