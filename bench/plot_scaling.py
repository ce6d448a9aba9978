#!/usr/bin/python3
"""Plots bench/scaling.sh RESULTS_TSV output: the example trainer's time per step against the one-way delay,
one panel per number of hosts, a line per configuration through the medians of its rounds (a dot each
round), the median of the rounds' communication rounds per step beside each median, and PowerSGD's
no-network floor as a dashed line.

    bench/plot_scaling.py OUT.png RUN.tsv [RUN.tsv ...]

Several files are several runs of the same grid: their rounds are pooled. Needs Debian's python3-matplotlib.
"""
import collections
import csv
import statistics
import sys

COLUMNS = ("hosts", "model", "delay", "config", "round", "epoch_s", "rounds_per_step", "steps")
NAMES = {"allreduce": "full allreduce", "powersgd": "PowerSGD, default", "alternating": "PowerSGD, alternating",
         "powersgd-each": "PowerSGD, bucket by bucket", "powersgd-bcube": "PowerSGD, bcube",
         "powersgd-before": "PowerSGD, build before"}


def delay_ms(text):
    """'0' -> 0.0, '5ms' -> 5.0, '250us' -> 0.25."""
    for suffix, scale in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def median_rounds(values):
    """The median of the rounds' communication rounds per step, as text; "-" where the trainer printed none."""
    known = [float(v) for v in values if v not in ("", "-")]
    if not known:
        return "-"
    median = statistics.median(known)
    return "%.1f" % median if abs(round(median, 1) - median) < 1e-9 else "%.2f" % median  # the trainer's %.1f


def read_runs(paths):
    """{(hosts, model): {config: {delay_ms: ([ms per step], [rounds per step])}}}, configs in first-seen order."""
    grid = collections.OrderedDict()
    for path in paths:
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f, delimiter="\t")
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise ValueError("%s: not bench/scaling.sh RESULTS_TSV output (no column %s)"
                                 % (path, ", ".join(missing)))
            for row in reader:
                panel = grid.setdefault((int(row["hosts"]), row["model"]), collections.OrderedDict())
                delay = None if row["config"] == "floor" else delay_ms(row["delay"])
                times, rounds = panel.setdefault(row["config"], {}).setdefault(delay, ([], []))
                times.append(float(row["epoch_s"]) * 1000 / int(row["steps"]))
                rounds.append(row["rounds_per_step"])
    return grid


def main(argv):
    if len(argv) < 3:
        sys.stderr.write(__doc__)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = read_runs(argv[2:])
    if not grid:
        sys.stderr.write("plot_scaling.py: no runs in %s\n" % ", ".join(argv[2:]))
        return 1
    fig, axes = plt.subplots(1, len(grid), figsize=(5.2 * len(grid), 4.4), squeeze=False)
    for ax, ((hosts, model), panel) in zip(axes[0], grid.items()):
        delays = sorted({d for runs in panel.values() for d in runs if d is not None})
        position = {d: i for i, d in enumerate(delays)}
        for config, runs in panel.items():
            if config == "floor":
                continue
            points = sorted((d, v) for d, v in runs.items() if d is not None)
            xs = [position[d] for d, _ in points]
            medians = [statistics.median(times) for _, (times, _) in points]
            (line,) = ax.plot(xs, medians, marker="o", label=NAMES.get(config, config))
            for x, (_, (times, rounds)), median in zip(xs, points, medians):
                ax.scatter([x] * len(times), times, s=9, color=line.get_color(), alpha=0.5)
                ax.annotate(median_rounds(rounds), (x, median), textcoords="offset points", xytext=(4, 4), fontsize=7,
                            color=line.get_color())
        if "floor" in panel:
            least = statistics.median(panel["floor"][None][0])
            ax.axhline(least, color="grey", linestyle="--", linewidth=1,
                       label="PowerSGD, no network (%.0f ms)" % least)
        ax.set_xticks(range(len(delays)))
        ax.set_xticklabels(["%g ms" % d for d in delays])
        ax.set_yscale("log")
        ax.set_xlabel("one-way delay into each host")
        ax.set_ylabel("ms per step (median; rounds per step beside it)")
        ax.set_title("%d hosts, %s" % (hosts, model))
        ax.grid(True, which="both", axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("the example trainer on emulated hosts (bench/scaling.sh): " + ", ".join(argv[2:]), fontsize=8)
    fig.tight_layout()
    fig.savefig(argv[1], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
