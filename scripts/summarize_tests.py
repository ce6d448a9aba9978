#!/usr/bin/env python3
"""Counts results in Meson testlog.json files, and in scripts/fuzz.sh's fuzz-results.tsv
(one line per fuzz target: target, OK|FAIL, executions, cov, ft, seconds); prints
'N passed, N failed, N skipped' last.

For each failed test it prints, before that line, what the failure said: its doctest failure blocks, or
else the end of its output. CI shows only the end of a run, where Meson's own error log has long scrolled by.

Exits 1 when a test failed or no test ran, so callers can use the exit code too.
"""
import json
import re
import sys

PASSED = {"OK", "EXPECTEDFAIL"}
SKIPPED = {"SKIP"}
MAX_LINE = 400  # characters kept of one line of a failed test's output
MAX_BLOCK_LINES = 60
MAX_BLOCKS = 4
TAIL_LINES = 40


def failure_excerpt(test):
    """The doctest blocks (between its '=====' rules) that report an error, else the output's last lines."""
    output = (test.get("stdout") or "") + (test.get("stderr") or "")
    lines = [line[:MAX_LINE] for line in output.splitlines()]
    blocks, current = [], []
    for line in lines:
        if re.fullmatch(r"={20,}", line):
            blocks.append(current)
            current = []
        else:
            current.append(line)
    blocks.append(current)
    failed = [b for b in blocks if any("ERROR:" in line or "FATAL ERROR" in line for line in b)]
    if not failed:
        return lines[-TAIL_LINES:]
    excerpt = []
    for block in failed[:MAX_BLOCKS]:
        excerpt += block[:MAX_BLOCK_LINES] + (["  ..."] if len(block) > MAX_BLOCK_LINES else []) + ["-" * 40]
    if len(failed) > MAX_BLOCKS:
        excerpt.append(f"  ({len(failed) - MAX_BLOCKS} more failure blocks)")
    return excerpt


def main(paths):
    passed = failed = skipped = 0
    excerpts = []
    for path in paths:
        if path.startswith("BUILD_FAILED:"):
            print(f"summary: FAILED build of {path.split(':', 1)[1]}")
            failed += 1
            continue
        if path.endswith(".tsv"):
            try:
                with open(path, encoding="utf-8") as table:
                    rows = [line.rstrip("\n").split("\t") for line in table if line.strip()]
            except OSError as err:
                print(f"summary: cannot read {path}: {err}")
                failed += 1
                continue
            for row in rows:
                if row[1:2] == ["OK"]:
                    passed += 1
                else:
                    failed += 1
                    print(f"summary: FAILED fuzz target {row[0]} in {path}")
            continue
        try:
            with open(path, encoding="utf-8") as log:
                lines = [json.loads(line) for line in log if line.strip()]
        except OSError as err:
            print(f"summary: cannot read {path}: {err}")
            failed += 1
            continue
        for test in lines:
            result = test.get("result")
            if result in PASSED:
                passed += 1
            elif result in SKIPPED:
                skipped += 1
            else:
                failed += 1
                excerpts.append((test.get("name"), result, failure_excerpt(test)))
                print(f"summary: FAILED ({result}) {test.get('name')} in {path}")
    for name, result, excerpt in excerpts:
        print(f"summary: what {name} ({result}) printed:")
        for line in excerpt:
            print(f"  | {line}")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
