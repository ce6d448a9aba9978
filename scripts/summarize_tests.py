#!/usr/bin/env python3
"""Counts results in Meson testlog.json files, and in scripts/fuzz.sh's fuzz-results.tsv
(one line per fuzz target: target, OK|FAIL, executions, cov, ft, seconds); prints
'N passed, N failed, N skipped' last.

Exits 1 when a test failed or no test ran, so callers can use the exit code too.
"""
import json
import sys

PASSED = {"OK", "EXPECTEDFAIL"}
SKIPPED = {"SKIP"}


def main(paths):
    passed = failed = skipped = 0
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
                print(f"summary: FAILED ({result}) {test.get('name')} in {path}")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
