#!/usr/bin/python3
"""Makes the table and the plot of bench/paper_table.sh from its per-row logs.

    bench/paper_table.py OUT_DIR

Reads OUT_DIR/<row>.log (train-fashion-mnist output under powersgd-run, first
line the command), writes OUT_DIR/table.md, OUT_DIR/table.json and
OUT_DIR/paper_table.png (test accuracy against epoch and against cumulative
bytes sent per rank). Rows whose run did not finish are named, not measured.
Needs Debian's python3-matplotlib for the plot.
"""
import json
import os
import re
import sys

ROWS = [
    ("allreduce", "plain allreduce"),
    ("rank1", "rank 1, error feedback"),
    ("rank2", "rank 2, error feedback"),
    ("rank4", "rank 4, error feedback"),
    ("rank2-no-ef", "rank 2, no error feedback"),
    ("rank2-no-warm-start", "rank 2, no warm start"),
    ("adaptive", "adaptive rank 1..4"),
    ("adaptive24", "adaptive rank 2..4"),
    ("alternating", "rank 2, alternating"),
    ("alternating4", "rank 4, alternating"),
]
EPOCH = re.compile(r"^\[0\] epoch (\d+): train loss ([0-9.]+), train accuracy ([0-9.]+)%, "
                   r"test accuracy ([0-9.]+)%, ([0-9.]+) s, lr ([0-9.e+-]+), (\d+) bytes sent per rank")
DONE = re.compile(r"^\[0\] (PowerSGD: .*sent per rank in all|sent .* MB of gradients per rank)")


def parse(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    command = lines[0][2:] if lines and lines[0].startswith("$ ") else ""
    epochs = []
    finished = False
    for line in lines:
        m = EPOCH.match(line)
        if m:
            epochs.append({"epoch": int(m[1]), "train_loss": float(m[2]), "train_accuracy": float(m[3]),
                           "test_accuracy": float(m[4]), "seconds": float(m[5]), "lr": float(m[6]),
                           "bytes": int(m[7])})
        finished = finished or bool(DONE.match(line))
    loads = [line.split(": ", 1)[1] for line in lines if line.startswith("# load")]
    problem = None
    if not finished or not epochs:
        errors = [line for line in lines if "error" in line.lower() or "train-fashion-mnist:" in line]
        problem = errors[-1].split("train-fashion-mnist: ", 1)[-1].strip() if errors else "the run did not finish"
    return {"command": command, "epochs": epochs, "problem": problem, "load": loads}


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = argv[1]
    rows = []
    for key, label in ROWS:
        path = os.path.join(out_dir, key + ".log")
        if os.path.exists(path):
            rows.append(dict(parse(path), key=key, label=label))
    measured = [r for r in rows if r["problem"] is None]
    if not measured:
        print(f"paper_table.py: no finished run logs in {out_dir}", file=sys.stderr)
        return 1
    base = next((r for r in measured if r["key"] == "allreduce"), None)
    for r in measured:
        r["final_test_accuracy"] = r["epochs"][-1]["test_accuracy"]
        r["bytes_sent"] = sum(e["bytes"] for e in r["epochs"])
        r["seconds_per_epoch"] = r["epochs"][-1]["seconds"] / len(r["epochs"])
        if base:
            r["compression"] = base_bytes(base) / r["bytes_sent"] if r["bytes_sent"] else None
            r["delta_points"] = r["final_test_accuracy"] - base["epochs"][-1]["test_accuracy"]

    md = ["| run | final test accuracy | vs allreduce | bytes sent per rank | compression | time per epoch |",
          "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["problem"] is not None:
            md.append(f"| {r['label']} | not measured: {r['problem']} | | | | |")
            continue
        delta = f"{r['delta_points']:+.2f} pt" if base else "-"
        comp = f"{r['compression']:.1f}x" if base and r.get("compression") else "-"
        md.append(f"| {r['label']} | {r['final_test_accuracy']:.2f}% | {delta} | {r['bytes_sent'] / 1e6:.2f} MB | "
                  f"{comp} | {r['seconds_per_epoch']:.1f} s |")
    text = "\n".join(md) + "\n"
    with open(os.path.join(out_dir, "table.md"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(out_dir, "table.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=2)
    print(text, end="")
    for r in rows:
        print(f"{r['key']}: {r['command']}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (by_epoch, by_bytes) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    for r in measured:
        epochs = [e["epoch"] for e in r["epochs"]]
        accuracy = [e["test_accuracy"] for e in r["epochs"]]
        sent, total = [], 0
        for e in r["epochs"]:
            total += e["bytes"]
            sent.append(total)
        style = "--" if r["key"] == "allreduce" else "-"
        by_epoch.plot(epochs, accuracy, style, marker="o", markersize=3, label=r["label"])
        by_bytes.plot(sent, accuracy, style, marker="o", markersize=3, label=r["label"])
    by_epoch.set_xlabel("epoch")
    by_epoch.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    by_bytes.set_xlabel("gradient bytes sent per rank (cumulative)")
    by_bytes.set_xscale("log")
    for ax in (by_epoch, by_bytes):
        ax.set_ylabel("test accuracy (%)")
        ax.grid(True, which="both", alpha=0.3)
    by_epoch.legend(fontsize=8)
    fig.suptitle("PowerSGD on the example CNN (Fashion-MNIST), " + str(len(measured)) + " runs", fontsize=10)
    fig.tight_layout()
    png = os.path.join(out_dir, "paper_table.png")
    fig.savefig(png)
    print(f"wrote {os.path.join(out_dir, 'table.md')}, {os.path.join(out_dir, 'table.json')}, {png}")
    return 0


def base_bytes(base):
    return sum(e["bytes"] for e in base["epochs"])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
