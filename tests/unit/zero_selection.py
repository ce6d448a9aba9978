"""zero-selection-fails: a test binary whose -tc filter selects no test case exits 1 and says so
(tests/support/doctest_main.hpp: the multiprocess cases are registered by -tc filters, so a renamed case must
fail CI). Checked here rather than by Meson's should_fail, which also counted a crash or a sanitizer abort on
that path as the expected failure.

    zero_selection.py TEST_BINARY
"""
import subprocess
import sys


def main():
    done = subprocess.run([sys.argv[1], "-tc=no test case has this name"], capture_output=True, text=True,
                          timeout=60)
    output = done.stdout + done.stderr
    words = "the command line selected no test case"
    problems = []
    if done.returncode != 1:
        problems.append("exit status %d, expected 1" % done.returncode)
    if words not in output:
        problems.append("no line saying '%s'" % words)
    if "Sanitizer" in output or "runtime error:" in output:
        problems.append("a sanitizer report")
    if problems:
        print("zero-selection: %s; output:\n%s" % ("; ".join(problems), output))
        return 1
    print("zero-selection: exit 1, '%s'" % words)
    return 0


if __name__ == "__main__":
    sys.exit(main())
