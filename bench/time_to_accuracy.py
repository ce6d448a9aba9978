#!/usr/bin/python3
"""Makes the table of bench/time_to_accuracy.sh from its logs.

    bench/time_to_accuracy.py OUT_DIR

Reads OUT_DIR/<rate>/<row>.log (train-fashion-mnist on an emulated cluster, first
line the command) and writes OUT_DIR/time_to_accuracy.md and .json: per rate, each
row's final test accuracy, bytes per rank, wall time of the run, and its time to
the allreduce row's final test accuracy at that rate (the trainer's clock at the
end of the first epoch whose test accuracy reaches it), and to half a point and one
point below it.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paper_table import parse  # noqa: E402  (the epoch lines are the paper table's)


def time_to(epochs, target):
    """The trainer's seconds at the end of the first epoch whose test accuracy is at least target, or None."""
    return next((e["seconds"] for e in epochs if e["test_accuracy"] >= target - 1e-9), None)


def summarize(rate_dir):
    runs = {}
    for name in sorted(os.listdir(rate_dir)):
        if name.endswith(".log"):
            runs[name[:-4]] = parse(os.path.join(rate_dir, name))
    base = runs.get("allreduce")
    target = base["epochs"][-1]["test_accuracy"] if base and base["problem"] is None else None
    rows = []
    order = sorted(runs, key=lambda k: (k != "allreduce", not k.startswith("rank"), k))
    for key in order:
        run = runs[key]
        row = {"key": key, "command": run["command"], "problem": run["problem"]}
        if run["problem"] is None:
            e = run["epochs"]
            row.update(final=e[-1]["test_accuracy"], bytes=sum(x["bytes"] for x in e), seconds=e[-1]["seconds"],
                       best=max(x["test_accuracy"] for x in e), epochs=len(e))
            if target is not None:
                row["to_target"] = time_to(e, target)
                row["to_target_minus_0.5"] = time_to(e, target - 0.5)
                row["to_target_minus_1"] = time_to(e, target - 1.0)
        rows.append(row)
    return rows, target


def fmt_time(t, base):
    """t seconds, and how many times allreduce's base seconds it is (allreduce's own row: base None)."""
    if t is None:
        return "not reached"
    return f"{t:.0f} s" + (f", {base / t:.2f}x faster than allreduce" if base and t > 0 else "")


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = argv[1]
    md, doc = [], {}
    for rate in sorted(os.listdir(out_dir), key=lambda r: (len(r), r), reverse=True):
        rate_dir = os.path.join(out_dir, rate)
        if not os.path.isdir(rate_dir):
            continue
        rows, target = summarize(rate_dir)
        if not rows:
            continue
        doc[rate] = {"target": target, "rows": rows}
        base = next((r for r in rows if r["key"] == "allreduce" and r["problem"] is None), None)
        md += [f"**{rate}**" + (f" (allreduce's final test accuracy: {target:.2f}%)" if target is not None else
                                " (no finished allreduce row: no target)"), "",
               "| row | final test accuracy | bytes per rank | run | to allreduce's accuracy | to 0.5 points below "
               "| to 1 point below |",
               "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            if r["problem"] is not None:
                md.append(f"| {r['key']} | {r['problem']} | | | | | |")
                continue
            ref = base if base is not r else None
            to, to05, to1 = (fmt_time(r.get(k), ref and ref.get(k))
                             for k in ("to_target", "to_target_minus_0.5", "to_target_minus_1"))
            md.append(f"| {r['key']} | {r['final']:.2f}% (best {r['best']:.2f}%) | {r['bytes'] / 1e6:.3f} MB | "
                      f"{r['seconds']:.0f} s | {to} | {to05} | {to1} |")
        md.append("")
    with open(os.path.join(out_dir, "time_to_accuracy.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(md))
    with open(os.path.join(out_dir, "time_to_accuracy.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
