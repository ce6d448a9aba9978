"""The checkpoint test of powersgd.torch (docs/torch.md, "Checkpoints"): three powersgd-run jobs on loopback.

    python3 checkpoint_resume.py POWERSGD_RUN DDP_HOOK_PY

1. 3 ranks, `ddp_hook.py checkpoint-save DIR`: the uninterrupted run (its parameters saved), then a run that
   saves model, optimizer and the pickled PowerSGDState with torch.save at iteration 6 and kills itself
   (SIGKILL on every rank: the launcher exits non-zero, which is expected).
2. 3 ranks, `checkpoint-resume DIR`: each rank resumes its own file; parameters bitwise equal to step 1's
   uninterrupted run; a fresh state with only `iter` restored trains on.
3. 2 ranks, `checkpoint-resume DIR`: both resume the job checkpoint rank 0 saved (mean error memory); rank 0's own
   file on both: error memory zero.
Exit 0 when all pass, 77 when torch is missing, else 1. Each job is bounded by the launcher's --timeout.
"""
import importlib.util
import os
import subprocess
import sys
import tempfile


def run(launcher, script, ranks, case, directory):
    command = [launcher, "-n", str(ranks), "--timeout", "300", "--", sys.executable, script, case, directory]
    print("+ " + " ".join(command), flush=True)
    return subprocess.run(command).returncode


def main():
    if importlib.util.find_spec("torch") is None:
        print("torch is not installed (Debian: python3-torch): skipped")
        return 77
    launcher, script = sys.argv[1:3]
    with tempfile.TemporaryDirectory(prefix="powersgd-ckpt-test-") as directory:
        code = run(launcher, script, 3, "checkpoint-save", directory)
        files = sorted(os.listdir(directory))
        expected = ["ckpt-rank%d.pt" % r for r in range(3)]
        if code == 0 or not set(expected) <= set(files):
            print("checkpoint-save: expected the job killed (non-zero exit) after writing %s; exit %d, files %s"
                  % (expected, code, files))
            return 1
        for ranks in (3, 2):
            if run(launcher, script, ranks, "checkpoint-resume", directory) != 0:
                print("checkpoint-resume on %d ranks failed" % ranks)
                return 1
    print("checkpoint: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
