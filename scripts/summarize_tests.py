#!/usr/bin/env python3
"""Counts results in Meson testlog.json files, and in scripts/fuzz.sh's fuzz-results.tsv
(one line per fuzz target: target, OK|FAIL, executions, cov, ft, seconds); prints
'N passed, N failed, N skipped' last.

For each failed test it prints, before that line, what the failure said (its doctest failure blocks, or
else the end of its output and its first error; 300 lines in all), then the list of failures. CI shows only
the end of a run, where Meson's own error log has long scrolled by.

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
MAX_EXCERPT_LINES = 300  # of all failed tests together: CI shows only the end of a run
# doctest's rules between test cases, also as powersgd-run prefixes a rank's lines ("[1] ====...").
RULE = re.compile(r"(\[\d+\] )?={20,}")


def around_error(lines, head, context, tail):
    """The first `head` lines, `context` lines from just before the first error, and the last `tail` lines."""
    first = next((i for i, line in enumerate(lines) if "ERROR" in line), len(lines))
    keep = sorted(set(range(min(head, len(lines))))
                  | set(range(max(0, first - 3), min(len(lines), first - 3 + context)))
                  | set(range(max(0, len(lines) - tail), len(lines))))
    excerpt, previous = [], -1
    for i in keep:
        if i != previous + 1:
            excerpt.append("  ...")
        excerpt.append(lines[i])
        previous = i
    return excerpt


def failure_excerpt(test):
    """The doctest blocks (between its rules) that report an error, else the output's end and its first error."""
    output = (test.get("stdout") or "") + (test.get("stderr") or "")
    lines = [line[:MAX_LINE] for line in output.splitlines()]
    blocks, current = [], []
    for line in lines:
        if RULE.fullmatch(line):
            blocks.append(current)
            current = []
        else:
            current.append(line)
    blocks.append(current)
    failed = [b for b in blocks if any("ERROR:" in line or "FATAL ERROR" in line for line in b)]
    if len(blocks) == 1 or not failed:  # no doctest report: the end, and the first error (a sanitizer's)
        return around_error(lines, 0, 20, TAIL_LINES)
    excerpt = []
    for block in failed[:MAX_BLOCKS]:
        excerpt += (block if len(block) <= MAX_BLOCK_LINES else around_error(block, 6, 30, 10)) + ["-" * 40]
    if len(failed) > MAX_BLOCKS:
        excerpt.append(f"  ({len(failed) - MAX_BLOCKS} more failure blocks)")
    return excerpt


def main(paths):
    passed = failed = skipped = 0
    excerpts, failures = [], []
    failed_in = {}  # failures counted from each log
    for path in paths:
        if path.startswith("RUNNER_FAILED:"):
            # meson test exited non-zero: one failure unless its log (read before: test.sh names it first)
            # recorded one; a runner killed or interrupted half-way left only the records of what passed.
            directory = path.split(":", 1)[1]
            if not any(count for log, count in failed_in.items() if log.startswith(directory + "/")):
                failures.append(f"summary: FAILED meson test in {directory}: it exited non-zero with no failed "
                                f"test recorded (interrupted or killed?)")
                failed += 1
            continue
        failed_before = failed
        if path.startswith("BUILD_FAILED:"):
            failures.append(f"summary: FAILED build of {path.split(':', 1)[1]}")
            failed += 1
            continue
        if path.endswith(".tsv"):
            try:
                with open(path, encoding="utf-8") as table:
                    rows = [line.rstrip("\n").split("\t") for line in table if line.strip()]
            except OSError as err:
                failures.append(f"summary: cannot read {path}: {err}")
                failed += 1
                continue
            for row in rows:
                if row[1:2] == ["OK"]:
                    passed += 1
                else:
                    failed += 1
                    failures.append(f"summary: FAILED fuzz target {row[0]} in {path}")
            continue
        try:
            with open(path, encoding="utf-8", errors="replace") as log:
                lines = [line for line in log if line.strip()]
        except OSError as err:
            failures.append(f"summary: cannot read {path}: {err}")
            failed += 1
            continue
        for number, line in enumerate(lines, 1):
            try:
                test = json.loads(line)
            except json.JSONDecodeError as err:  # a log cut short
                failures.append(f"summary: line {number} of {path} is not a test's record: {err}")
                failed += 1
                continue
            result = test.get("result")
            if result in PASSED:
                passed += 1
            elif result in SKIPPED:
                skipped += 1
            else:
                failed += 1
                excerpts.append((test.get("name"), result, failure_excerpt(test)))
                failures.append(f"summary: FAILED ({result}) {test.get('name')} in {path}")
        failed_in[path] = failed - failed_before
    # The excerpts first, so that the list of failures stays in the end CI shows.
    budget = MAX_EXCERPT_LINES
    for name, result, excerpt in excerpts:
        if budget <= 0:
            print(f"summary: (no room left to show what {name} printed)")
            continue
        print(f"summary: what {name} ({result}) printed:")
        for line in excerpt[:budget]:
            print(f"  | {line}")
        budget -= len(excerpt)
    for failure in failures:
        print(failure)
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
