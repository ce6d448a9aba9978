#!/usr/bin/python3
"""Plots `powersgd-bench sweep --json` output: relative approximation error
against bytes reduced per step per rank, one point per PowerSGD rank r.

    bench/plot_sweep.py sweep.json sweep.png

Needs Debian's python3-matplotlib (apt-get install python3-matplotlib).
"""
import json
import sys


def main(argv):
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        doc = json.load(f)
    if doc.get("benchmark") != "sweep" or not doc.get("ranks"):
        print(f"plot_sweep.py: {argv[1]} is not powersgd-bench sweep output", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["ranks"]
    x = [row["bytes_per_step"] for row in rows]
    y = [row["relative_error"] for row in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    ax.plot(x, y, "o-", label=f"PowerSGD, error after {doc['steps']} steps")
    for row in rows:
        ax.annotate(f"r={row['rank']}", (row["bytes_per_step"], row["relative_error"]),
                    textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.axvline(doc["uncompressed_bytes_per_step"], color="grey", linestyle="--", label="plain allreduce")
    ax.set_xscale("log")
    ax.set_xlabel("bytes reduced per step per worker")
    ax.set_ylabel("relative error ||M - PQ^T|| / ||M||")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title("How low can communication go? " + doc["record"].split("/")[-1], fontsize=10)
    fig.tight_layout()
    fig.savefig(argv[2])
    print(f"wrote {argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
