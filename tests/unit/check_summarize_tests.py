#!/usr/bin/env python3
"""scripts/summarize_tests.py on made-up Meson logs: the counts, the last line, the exit status, and what a failed
test printed (its doctest failure blocks, prefixed by a rank or not; else its output's end and first error)
shown before the list of failures and that line.

  check_summarize_tests.py SOURCE_ROOT
"""
import json
import os
import subprocess
import sys
import tempfile

DOCTEST_FAILURE = "\n".join([
    "[doctest] doctest version is \"2.4.9\"",
    "=" * 79,
    "test_launcher.cpp:1015:",
    "TEST CASE:  a passing case",
    "MESSAGE: fine",
    "=" * 79,
    "test_launcher.cpp:1021:",
    "TEST CASE:  a rank that dies inside Communicator::create",
    "test_launcher.cpp:1030: ERROR: CHECK( seconds < 3.0 + 1.5 ) is NOT correct!",
    "  values: CHECK( 4.9 < 4.5 )",
    "  logged: stdout: [0] lost where=create code=3 seconds=4.9",
    "=" * 79,
    "[doctest] test cases: 2 | 1 passed | 1 failed",
])


def run(root, tests, tsv_rows=None):
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "testlog.json")
        with open(log, "w", encoding="utf-8") as out:
            for test in tests:
                out.write(json.dumps(test) + "\n")
        paths = [log]
        if tsv_rows is not None:
            tsv = os.path.join(tmp, "fuzz-results.tsv")
            with open(tsv, "w", encoding="utf-8") as out:
                out.write("".join("\t".join(row) + "\n" for row in tsv_rows))
            paths.append(tsv)
        done = subprocess.run([sys.executable, os.path.join(root, "scripts", "summarize_tests.py")] + paths,
                              capture_output=True, text=True, check=False)
        return done.returncode, done.stdout.splitlines()


def expect(condition, what, lines):
    if not condition:
        print(f"FAILED: {what}; the summary printed:\n" + "\n".join(lines))
        sys.exit(1)


def main(root):
    code, lines = run(root, [{"name": "a", "result": "OK"}, {"name": "b", "result": "SKIP"},
                             {"name": "c", "result": "EXPECTEDFAIL"}], [["fuzz_x", "OK", "5", "1", "1", "60"]])
    expect(code == 0 and lines[-1] == "3 passed, 0 failed, 1 skipped", "all passed", lines)

    long_tail = "\n".join(f"line {i}" for i in range(100))
    code, lines = run(root, [
        {"name": "s:launcher", "result": "FAIL", "stdout": DOCTEST_FAILURE},
        {"name": "s:script", "result": "TIMEOUT", "stdout": long_tail},
        {"name": "s:ok", "result": "OK", "stdout": "ERROR: not a failure"}])
    expect(code == 1 and lines[-1] == "1 passed, 2 failed, 0 skipped", "two failed", lines)
    text = "\n".join(lines)
    expect("summary: FAILED (FAIL) s:launcher" in text and "summary: FAILED (TIMEOUT) s:script" in text,
           "each failure named", lines)
    expect("  | test_launcher.cpp:1030: ERROR: CHECK( seconds < 3.0 + 1.5 ) is NOT correct!" in lines,
           "the doctest error shown", lines)
    expect("  |   logged: stdout: [0] lost where=create code=3 seconds=4.9" in lines, "its logged context", lines)
    expect("a passing case" not in text, "only the failing doctest block", lines)
    expect("  | line 99" in lines and "  | line 60" in lines and "  | line 59" not in lines,
           "the last 40 lines of a test without doctest blocks", lines)
    expect("not a failure" not in text, "nothing of a passed test", lines)
    expect(text.index("what s:launcher") < text.index(lines[-1]), "the excerpts before the last line", lines)

    # Under powersgd-run every line of a rank is prefixed ("[1] "), its rules too; a sanitizer's report has no
    # rules at all and may stand far from the end.
    prefixed = "\n".join("[1] " + line for line in DOCTEST_FAILURE.splitlines())
    asan = "\n".join([f"line {i}" for i in range(70)] + ["==123==ERROR: AddressSanitizer: heap-use-after-free"]
                     + [f"frame {i}" for i in range(100)])
    code, lines = run(root, [{"name": "s:ranks", "result": "FAIL", "stdout": prefixed},
                             {"name": "s:asan", "result": "FAIL", "stdout": asan}])
    text = "\n".join(lines)
    expect("  | [1] test_launcher.cpp:1030: ERROR: CHECK( seconds < 3.0 + 1.5 ) is NOT correct!" in lines
           and "a passing case" not in text, "a rank's doctest block, its rules prefixed", lines)
    expect("  | ==123==ERROR: AddressSanitizer: heap-use-after-free" in lines and "  | frame 99" in lines,
           "a sanitizer's error far from the end, and the end", lines)
    expect(text.index("summary: FAILED (FAIL) s:asan") > text.index("  | frame 99"),
           "the list of failures after the excerpts", lines)

    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "testlog.json")
        with open(log, "w", encoding="utf-8") as out:
            out.write(json.dumps({"name": "a", "result": "OK"}) + "\n" + '{"name": "b", "resu')
        done = subprocess.run([sys.executable, os.path.join(root, "scripts", "summarize_tests.py"), log],
                              capture_output=True, text=True, check=False)
        lines = done.stdout.splitlines()
        expect(done.returncode == 1 and lines[-1] == "1 passed, 1 failed, 0 skipped",
               "a log cut short: its last record a failure", lines)

    code, lines = run(root, [])
    expect(code == 1 and lines[-1] == "0 passed, 0 failed, 0 skipped", "no test ran: exit 1", lines)

    # meson test exited non-zero: a failure where its log recorded none, none more where it did.
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "meson-logs", "testlog.json")
        os.makedirs(os.path.dirname(log))
        summarize = [sys.executable, os.path.join(root, "scripts", "summarize_tests.py"), log, "RUNNER_FAILED:" + tmp]
        for records, last in [([{"name": "a", "result": "OK"}], "1 passed, 1 failed, 0 skipped"),
                              ([{"name": "a", "result": "FAIL"}], "0 passed, 1 failed, 0 skipped")]:
            with open(log, "w", encoding="utf-8") as out:
                out.write("".join(json.dumps(r) + "\n" for r in records))
            done = subprocess.run(summarize, capture_output=True, text=True, check=False)
            lines = done.stdout.splitlines()
            expect(done.returncode == 1 and lines[-1] == last, "meson test exited non-zero: " + last, lines)
    print("summarize_tests.py: counts, exit status and failure excerpts as expected")


if __name__ == "__main__":
    main(sys.argv[1])
