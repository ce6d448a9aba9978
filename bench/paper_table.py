#!/usr/bin/python3
"""Makes the table and the figures of bench/paper_table.sh from its logs.

    bench/paper_table.py OUT_DIR

Reads OUT_DIR/<model>/<row>-s<seed>.log (train-fashion-mnist under powersgd-run,
first line the command) and writes:
  OUT_DIR/table.md     per model: each row's final test accuracy (mean and
                       standard error over the seeds), its difference from plain
                       allreduce (with the standard error of the difference),
                       bytes per rank, compression, and the verdicts on the issue's
                       targets;
  OUT_DIR/table.json   the same with every seed's per-epoch figures;
  OUT_DIR/paper_table-<model>.png  test accuracy against epoch and against
                       cumulative bytes per rank (means over the seeds, error bars
                       one standard error);
  OUT_DIR/decisions-<model>-<row>.png  the rank per step of the policy rows (seed
                       1's decision log) when bench/plot_decisions.py exists.
Runs that did not finish are named, not measured. "Reaches allreduce": the mean is
at most one standard error of the difference below allreduce's mean; where the row or
allreduce has one finished seed, that standard error is unknown and the verdict reads
"n/a (one seed)". Needs Debian's python3-matplotlib for the figures; without it the
table is written all the same.
"""
import json
import math
import os
import re
import subprocess
import sys

ROWS = [
    ("allreduce", "plain allreduce"),
    ("rank1", "rank 1, error feedback"),
    ("rank2", "rank 2, error feedback"),
    ("rank4", "rank 4, error feedback"),
    ("rank8", "rank 8, error feedback"),
    ("rank2-no-ef", "rank 2, no error feedback"),
    ("rank2-no-warm-start", "rank 2, no warm start"),
    ("adaptive", "norm-change rule (adaptive)"),
    ("policy", "policy: warm-up + lr notes"),
    ("policy-adaptive", "policy: warm-up + lr notes + norm-change rule"),
    ("alternating", "rank 2, alternating"),
    ("rank2-bf16", "rank 2, bf16 factors"),
    ("policy-4-8", "policy 4..8: warm-up + lr notes"),
    ("policy-adaptive-4-8", "policy 4..8: warm-up + lr notes + norm-change rule"),
    ("policy-warmup-4-8", "policy 4..8: warm-up only"),
]
FIXED = ["rank1", "rank2", "rank4", "rank8"]
# Local steps (docs/local-steps.md): localH, localH-rankR, localH-rankR-no-ef, after the rows above.
LOCAL = re.compile(r"^local(\d+)(?:-rank(\d+))?(-no-ef)?$")


def local_rows(keys):
    """(key, label) of the local-step rows among keys: uncompressed first, then by rank, H and error feedback."""
    found = [(k, LOCAL.match(k)) for k in keys]
    found = [(k, m) for k, m in found if m]
    found.sort(key=lambda km: (int(km[1][2] or 0), bool(km[1][3]), int(km[1][1])))
    return [(k, f"{m[1]} local steps, outer step " +
             (f"rank {m[2]}, " + ("no error feedback" if m[3] else "error feedback") if m[2] else "uncompressed"))
            for k, m in found]
MODELS = [("wide", "wide MLP 784-1024-1024-10"), ("cnn", "CNN")]
EPOCH = re.compile(r"^\[0\] epoch (\d+): train loss ([0-9.]+), train accuracy ([0-9.]+)%, "
                   r"test accuracy ([0-9.]+)%, ([0-9.]+) s, lr ([0-9.e+-]+), (\d+) bytes sent per rank")
DONE = re.compile(r"^\[0\] (PowerSGD: .*sent per rank in all|sent .* MB of gradients per rank)")
LOG = re.compile(r"^(.+)-s(\d+)\.log$")
WALL = re.compile(r"wall (\d+) s")
FAILURE = re.compile(r"error:|train-fashion-mnist: |powersgd-run: ", re.IGNORECASE)


def parse(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    command = lines[0][2:] if lines and lines[0].startswith("$ ") else ""
    epochs, finished, wall = [], False, None
    for line in lines:
        m = EPOCH.match(line)
        if m:
            epochs.append({"epoch": int(m[1]), "train_loss": float(m[2]), "train_accuracy": float(m[3]),
                           "test_accuracy": float(m[4]), "seconds": float(m[5]), "lr": float(m[6]),
                           "bytes": int(m[7])})
        finished = finished or bool(DONE.match(line))
        w = WALL.search(line) if line.startswith("# load after") else None
        if w:
            wall = int(w[1])
    problem = None
    if not finished or not epochs:
        # Failure messages ("...: error: ...", the trainer's or the launcher's), not "no error feedback".
        errors = [line for line in lines if FAILURE.search(line)]
        problem = errors[-1].split("train-fashion-mnist: ", 1)[-1].strip() if errors else "the run did not finish"
        if not any(line.startswith("# load after") for line in lines) and not errors:
            problem = "still running"
    return {"command": command, "epochs": epochs, "problem": problem, "wall_seconds": wall}


def mean_se(values):
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def summarize(model_dir):
    runs = {}
    for name in sorted(os.listdir(model_dir)):
        m = LOG.match(name)
        if m:
            runs.setdefault(m[1], []).append(dict(parse(os.path.join(model_dir, name)), seed=int(m[2])))
    rows = []
    for key, label in ROWS + local_rows(runs):
        if key not in runs:
            continue
        seeds = sorted(runs[key], key=lambda r: r["seed"])
        done = [r for r in seeds if r["problem"] is None]
        row = {"key": key, "label": label, "runs": seeds, "seeds": [r["seed"] for r in done],
               "failed": [{"seed": r["seed"], "problem": r["problem"]} for r in seeds if r["problem"] is not None]}
        if done:
            finals = [r["epochs"][-1]["test_accuracy"] for r in done]
            row["final_test_accuracy"] = finals
            row["mean"], row["se"] = mean_se(finals)
            row["bytes"] = [sum(e["bytes"] for e in r["epochs"]) for r in done]
            row["bytes_mean"] = sum(row["bytes"]) / len(row["bytes"])
            walls = [r["wall_seconds"] for r in done if r["wall_seconds"] is not None]
            row["wall_seconds_mean"] = sum(walls) / len(walls) if walls else None
        rows.append(row)
    base = next((r for r in rows if r["key"] == "allreduce" and "mean" in r), None)
    for r in rows:
        if base and "mean" in r:
            r["delta"] = r["mean"] - base["mean"]
            # The SE of the difference needs both SEs: unknown (NaN) where the row or allreduce has one seed.
            r["delta_se"] = math.sqrt(r["se"] ** 2 + base["se"] ** 2)
            r["compression"] = base["bytes_mean"] / r["bytes_mean"] if r["bytes_mean"] else None
            # None: no verdict (one seed), not "does not reach".
            r["reaches_1se"] = None if math.isnan(r["delta_se"]) else r["delta"] >= -r["delta_se"]
            r["reaches_03"] = r["delta"] >= -0.3
    return rows, base


ONE_SEED = "n/a (one seed)"


def fmt_delta(r, unit):
    """A row's difference from allreduce in points, with its standard error where there is one."""
    if math.isnan(r["delta_se"]):
        return f"{r['delta']:+.2f}{unit} (one seed: no SE)"
    return f"{r['delta']:+.2f} ± {r['delta_se']:.2f}{unit}"


def verdicts(model, rows, base):
    """The issue's two targets, from the figures (the first is the wide model's). A verdict that needs the standard
    error of a difference reads ONE_SEED where the row or allreduce has one finished seed."""
    out = []
    if not base:
        return ["no allreduce row: no verdict"]
    by_key = {r["key"]: r for r in rows if "mean" in r}
    r2 = by_key.get("rank2")
    if r2 and model == "wide":
        compression = r2["compression"] or 0
        if compression <= 100:
            target = "not met"
        elif r2["reaches_03"] or r2["reaches_1se"]:
            target = "met"
        else:
            target = ONE_SEED if r2["reaches_1se"] is None else "not met"
        out.append(f"rank 2 with error feedback: {fmt_delta(r2, ' points')} from allreduce at {compression:.1f}x less "
                   f"traffic: target (within one SE or 0.3 points, > 100x) {target}")
    fixed = [by_key[k] for k in FIXED if k in by_key]
    reaching = [r for r in fixed if r["reaches_1se"]]
    unknown = [r for r in fixed if r["reaches_1se"] is None]
    smallest = min(reaching, key=lambda r: r["bytes_mean"]) if reaching else None
    if smallest:
        below = [r["label"] for r in unknown if r["bytes_mean"] < smallest["bytes_mean"]]
        out.append(f"smallest fixed rank reaching allreduce (within one SE): {smallest['label']}, "
                   f"{smallest['bytes_mean'] / 1e6:.2f} MB per rank" +
                   (f"; fewer bytes, {ONE_SEED}: {'; '.join(below)}" if below else ""))
    elif unknown:
        out.append(f"smallest fixed rank reaching allreduce within one SE: {ONE_SEED} for "
                   f"{'; '.join(r['label'] for r in unknown)}" +
                   ("; the others do not reach it" if len(unknown) < len(fixed) else ""))
    elif fixed:  # a table of local-step rows alone has no fixed-rank verdict
        out.append("no fixed rank reaches allreduce within one SE")
    for key in ("adaptive", "policy", "policy-adaptive", "policy-4-8", "policy-adaptive-4-8", "policy-warmup-4-8"):
        p = by_key.get(key)
        if not p:
            continue
        if p["reaches_1se"] is None:
            reach, target = f"{ONE_SEED} whether it reaches", ONE_SEED
        elif not p["reaches_1se"]:
            reach, target = "does not reach", "not met"
        elif smallest:
            reach = "reaches"
            target = "met" if smallest["bytes_mean"] >= 1.5 * p["bytes_mean"] else "not met"
        else:  # no fixed rank to compare with: unknown where a fixed rank has one seed
            reach, target = "reaches", ONE_SEED if unknown else "not met"
        ratio = f", {smallest['bytes_mean'] / p['bytes_mean']:.2f}x fewer bytes than {smallest['label']}" \
            if smallest else ""
        out.append(f"{p['label']}: {reach} allreduce ({fmt_delta(p, ' points')}){ratio}: "
                   f"target (reaches, >= 1.5x fewer bytes) {target}")
    # Local steps (issue 31): a row within one SE of allreduce at >= 1000x fewer bytes per rank over the run.
    local = [r for r in rows if "mean" in r and LOCAL.match(r["key"]) and r.get("compression")]
    if local:
        far = [r for r in local if r["compression"] >= 1000]
        reaching = [r for r in far if r["reaches_1se"]]
        unknown_far = [r for r in far if r["reaches_1se"] is None]
        if reaching:
            shown, which = max(reaching, key=lambda r: r["compression"]), "the most compressed that does"
        else:
            shown, which = max(far or local, key=lambda r: r["delta"]), "the closest"
        verdict = "met" if reaching else ONE_SEED if unknown_far else "not met"
        one_seed = f", {len(unknown_far)} with one seed" if unknown_far else ""
        out.append(f"local steps, within one SE of allreduce at >= 1000x fewer bytes: "
                   f"{verdict} ({len(reaching)} of {len(far)} rows at >= 1000x reach it{one_seed}; "
                   f"{which}: {shown['label']}, {fmt_delta(shown, ' points')} at {shown['compression']:.0f}x)")
    return out


def fmt_pm(mean, se):
    return f"{mean:.2f}%" if math.isnan(se) else f"{mean:.2f} ± {se:.2f}%"


def markdown(model_label, rows, base, notes):
    md = [f"**{model_label}**", "",
          "| run | seeds | final test accuracy (mean ± SE) | vs allreduce (± SE) | bytes per rank | compression "
          "| wall per run |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        failed = "".join(f"; seed {f['seed']} " + ("still running" if f["problem"] == "still running" else
                                                   f"failed: {f['problem']}") for f in r["failed"])
        if "mean" not in r:
            md.append(f"| {r['label']} | - | not measured{failed} | | | | |")
            continue
        delta = fmt_delta(r, " pt") if base else "-"
        if base and r["key"] != "allreduce" and r["reaches_1se"]:
            delta += " (within 1 SE)"
        comp = f"{r['compression']:.1f}x" if base and r.get("compression") else "-"
        wall = f"{r['wall_seconds_mean']:.0f} s" if r["wall_seconds_mean"] is not None else "-"
        md.append(f"| {r['label']} | {len(r['seeds'])}{failed} | {fmt_pm(r['mean'], r['se'])} | {delta} | "
                  f"{r['bytes_mean'] / 1e6:.3f} MB | {comp} | {wall} |")
    md.append("")
    md += [f"- {n}" for n in notes]
    return "\n".join(md) + "\n"


def figures(out_dir, model, model_label, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (by_epoch, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.6), dpi=100)
    colors = plt.cm.tab20.colors[::2] + plt.cm.tab20.colors[1::2]  # 20 distinct colours, the first 10 dark
    for row_index, r in enumerate(rows):
        done = [run for run in r["runs"] if run["problem"] is None]
        if not done:
            continue
        n_epochs = min(len(run["epochs"]) for run in done)
        xs, ms, ses, sent = [], [], [], []
        for i in range(n_epochs):
            m, se = mean_se([run["epochs"][i]["test_accuracy"] for run in done])
            xs.append(i + 1)
            ms.append(m)
            ses.append(0 if math.isnan(se) else se)
            sent.append(sum(sum(e["bytes"] for e in run["epochs"][:i + 1]) for run in done) / len(done))
        style = "--" if r["key"] == "allreduce" else "-"
        kw = dict(fmt=style, marker="o", markersize=3, capsize=2, label=r["label"], color=colors[row_index % len(colors)])
        by_epoch.errorbar(xs, ms, yerr=ses, **kw)
        by_bytes.errorbar(sent, ms, yerr=ses, **kw)
    by_epoch.set_xlabel("epoch")
    by_epoch.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    by_bytes.set_xlabel("gradient bytes sent per rank (cumulative)")
    by_bytes.set_xscale("log")
    for ax in (by_epoch, by_bytes):
        ax.set_ylabel("test accuracy (%), 10,000 images")
        ax.grid(True, which="both", alpha=0.3)
    by_epoch.legend(fontsize=7)
    seeds = max((len(r.get("seeds", [])) for r in rows), default=0)
    fig.suptitle(f"PowerSGD, {model_label} on Fashion-MNIST: mean of up to {seeds} seeds, bars one standard error",
                 fontsize=10)
    fig.tight_layout()
    png = os.path.join(out_dir, f"paper_table-{model}.png")
    fig.savefig(png)
    plt.close(fig)
    written = [png]
    plot = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plot_decisions.py")
    for r in rows:
        log = os.path.join(out_dir, model, f"{r['key']}-s1.decisions.jsonl")
        train_log = os.path.join(out_dir, model, f"{r['key']}-s1.log")
        if os.path.exists(plot) and os.path.exists(log):
            dec_png = os.path.join(out_dir, f"decisions-{model}-{r['key']}.png")
            # plot_decisions.py DECISIONS OUT [--train-log TRAINER_OUTPUT]
            cmd = [sys.executable, plot, log, dec_png]
            if os.path.exists(train_log):
                cmd += ["--train-log", train_log]
            done = subprocess.run(cmd, check=False)
            if done.returncode == 0:
                written.append(dec_png)
            else:
                print(f"paper_table.py: warning: no {dec_png}: plot_decisions.py exited {done.returncode} "
                      f"({' '.join(cmd)})", file=sys.stderr)
    return written


def no_nan(value):
    """value with every NaN (a standard error of one seed) as None: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [no_nan(v) for v in value]
    return value


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = argv[1]
    text, doc, plots = [], {}, []
    for model, label in MODELS:
        model_dir = os.path.join(out_dir, model)
        if not os.path.isdir(model_dir):
            continue
        rows, base = summarize(model_dir)
        if not rows:
            continue
        notes = verdicts(model, rows, base)
        text.append(markdown(label, rows, base, notes))
        doc[model] = {"label": label, "rows": rows, "verdicts": notes}
        if any("mean" in r for r in rows):
            plots.append((model, label, rows))
    if not doc:
        print(f"paper_table.py: no run logs in {out_dir}/<model>/", file=sys.stderr)
        return 1
    # The table first: the figures need matplotlib, the table does not.
    md = "\n".join(text)
    with open(os.path.join(out_dir, "table.md"), "w", encoding="utf-8") as f:
        f.write(md)
    with open(os.path.join(out_dir, "table.json"), "w", encoding="utf-8") as f:
        json.dump(no_nan(doc), f, indent=1)
    written = []
    for model, label, rows in plots:
        try:
            written += figures(out_dir, model, label, rows)
        except ImportError as error:
            print(f"paper_table.py: warning: no figures ({error}; Debian: python3-matplotlib); the table is "
                  f"written", file=sys.stderr)
            break
    print(md, end="")
    for model, d in doc.items():
        for r in d["rows"]:
            if r["runs"]:
                print(f"{model} {r['key']}: {r['runs'][0]['command']}")
    print("wrote " + ", ".join([os.path.join(out_dir, "table.md"), os.path.join(out_dir, "table.json")] + written))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
