#!/usr/bin/env bash
# packaging suite: `pip install .` as a PyTorch user runs it (docs/install.md). A fresh venv
# that sees the system's packages (Debian's torch and meson-python), pip offline with Debian's build backend
# (--no-build-isolation --no-index), from a copy of the source tree; then, from a directory outside any source
# tree and with neither PYTHONPATH nor LD_LIBRARY_PATH: the wheel is tagged for the platform, `import
# powersgd.torch` loads the libpowersgd inside the installed package, powersgd.__version__ is the library's
# psgd_version(), and examples/torch_ddp.py trains one short epoch under torchrun (2 ranks, loopback); the
# programs the wheel puts in the venv's bin (powersgd-run, powersgd-bench, powersgd-halve, train-fashion-mnist)
# run from there: `powersgd-run --help`, a 2-worker training run of the C++ trainer and of the DDP example (the
# venv's python by its path), and powersgd-halve's curve on a tiny job.
# Debian's python3 with python3-venv, python3-pip, python3-mesonpy and python3-torch.
#   pip_venv.sh SOURCE_DIR BUILD_DIR
# Exit 77 (skipped) without python3-venv, python3-pip, python3-mesonpy, python3-torch or dataset-fashion-mnist.
# KEEP_WORK=1 keeps the work directory (BUILD_DIR/packaging-pip.*: the copy, its build, the venv, pip.log).
set -euo pipefail
source_dir=$(cd "$1" && pwd)
build_dir=$(cd "$2" && pwd)
python=/usr/bin/python3
data=/usr/share/datasets/fashion-mnist
skip() { echo "pip_venv: $1: skipped"; exit 77; }
"$python" -c 'import ensurepip, venv' 2>/dev/null || skip "no venv module with ensurepip (Debian: python3-venv)"
"$python" -c 'import pip' 2>/dev/null || skip "no pip (Debian: python3-pip)"
"$python" -c 'import mesonpy' 2>/dev/null || skip "no meson-python (Debian: python3-mesonpy)"
"$python" -c 'import torch' 2>/dev/null || skip "no torch (Debian: python3-torch)"
[ -f "$data/train-images-idx3-ubyte.gz" ] || skip "no $data (Debian: dataset-fashion-mnist)"
unset PYTHONPATH LD_LIBRARY_PATH

# Under the build directory: the copy's build lies at the depth of a build of the tree (SRC/build), so the
# shared ccache (base_dir) serves the compiles of earlier runs.
work=$(mktemp -d "$build_dir/packaging-pip.XXXXXX")
trap '[ -n "${KEEP_WORK:-}" ] || rm -rf "$work"' EXIT
mkdir "$work/src" "$work/run"
if git -C "$source_dir" rev-parse --git-dir >/dev/null 2>&1; then
  (cd "$source_dir" && git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf -) | tar -xf - -C "$work/src"
else
  (cd "$source_dir" && tar --exclude='./build*' --exclude=./.git -cf - .) | tar -xf - -C "$work/src"
fi

# The copy's wheel is compiled as this build is (its debug, optimization and werror options, through
# pyproject.toml's meson-python arguments), so the compiles are those of this build, which the shared ccache
# holds; the CUDA module is left out (nvcc is slow; the module goes where the library goes).
options=$(meson introspect --buildoptions "$build_dir" | "$python" -c '
import json, sys
values = {o["name"]: o["value"] for o in json.load(sys.stdin)}
print(", ".join(repr("-D%s=%s" % (name, str(values[name]).lower())) for name in ("debug", "optimization", "werror")))')
grep -q '^setup = \["-Dwheel=true"\]$' "$work/src/pyproject.toml" || { echo "pip_venv: pyproject.toml has no 'setup = [\"-Dwheel=true\"]' line"; exit 1; }
sed -i "s/^setup = \[\"-Dwheel=true\"\]\$/setup = [\"-Dwheel=true\", $options, '-Dcuda=disabled']/" "$work/src/pyproject.toml"
grep '^setup = ' "$work/src/pyproject.toml"

# Debian's pip, which the venv sees, does the install (ensurepip would copy it in: same pip, a minute more
# on a loaded 2-core host).
"$python" -m venv --system-site-packages --without-pip "$work/venv"
venv_python=$work/venv/bin/python
start=$(date +%s)
if ! (cd "$work/src" && "$venv_python" -m pip install --no-build-isolation --no-index --no-deps \
        --config-settings=builddir=build . ) >"$work/pip.log" 2>&1; then
  tail -40 "$work/pip.log"
  echo "pip_venv: pip install failed (log above)"
  exit 1
fi
echo "pip_venv: pip install . took $(( $(date +%s) - start )) s"

# From outside the source tree: the installed package, its own library, the library's version.
cp "$source_dir/examples/torch_ddp.py" "$work/run/"
cd "$work/run"
"$venv_python" - "$work/venv" <<'PY'
import glob, os, sys
venv = os.path.realpath(sys.argv[1])
wheel_files = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "powersgd-*.dist-info", "WHEEL"))
if len(wheel_files) != 1:
    sys.exit("pip_venv: expected one powersgd dist-info in the venv, found %s" % wheel_files)
tags = [line.split(":", 1)[1].strip() for line in open(wheel_files[0]) if line.startswith("Tag:")]
purelib = [line.split(":", 1)[1].strip() for line in open(wheel_files[0]) if line.startswith("Root-Is-Purelib:")]
if not tags or any(tag.endswith("-any") or "linux" not in tag for tag in tags) or purelib != ["false"]:
    sys.exit("pip_venv: the wheel is tagged %s (Root-Is-Purelib %s); it holds a native library" % (tags, purelib))
import powersgd
import powersgd.torch  # noqa: F401
from powersgd import _capi
package_dir = os.path.dirname(os.path.realpath(powersgd.__file__))
if not package_dir.startswith(venv + os.sep):
    sys.exit("pip_venv: powersgd imported from %s, not from the venv %s" % (package_dir, venv))
loaded = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libpowersgd" in line})
if len(loaded) != 1 or os.path.dirname(loaded[0]) != package_dir:
    sys.exit("pip_venv: libpowersgd loaded from %s, expected it inside %s" % (loaded, package_dir))
library_version = _capi.lib.psgd_version().decode()
if powersgd.__version__ != library_version:
    sys.exit("pip_venv: powersgd.__version__ %s, psgd_version() %s" % (powersgd.__version__, library_version))
print("pip_venv: wheel %s; powersgd %s from %s, library %s" % (tags[0], powersgd.__version__, package_dir, loaded[0]))
PY

# The DDP example under torchrun, the venv's python running it.
OMP_NUM_THREADS=1 timeout 300 "$venv_python" "$source_dir/tests/python/torchrun_env.py" --torchrun \
  "$work/run/torch_ddp.py" --epochs 1 --train-limit 2000 --data "$data" | tee "$work/train.log"
grep -q "accuracy" "$work/train.log" || { echo "pip_venv: the example printed no accuracy line"; exit 1; }

# The programs in the venv's bin (pip's scripts directory), as a pip user finds them on PATH: no build tree,
# no LD_LIBRARY_PATH; train-fashion-mnist finds the libpowersgd inside the installed package.
bin=$work/venv/bin
for program in powersgd-run powersgd-bench powersgd-halve train-fashion-mnist; do
  [ -x "$bin/$program" ] || { echo "pip_venv: the wheel put no $program in $bin: $(ls "$bin" | tr '\n' ' ')"; exit 1; }
done
# (Into a file, not a pipe: grep -q would leave at the first match and SIGPIPE the rest of the help.)
"$bin/powersgd-run" --help >"$work/run-help.txt"
grep -q -- '-n' "$work/run-help.txt" || { echo "pip_venv: powersgd-run --help printed no usage"; exit 1; }
"$bin/powersgd-bench" --help >/dev/null
PATH=$bin:$PATH timeout 300 powersgd-run -n 2 --timeout 240 -- train-fashion-mnist --data "$data" --epochs 1 \
  --train-limit 512 --test-limit 128 --batch 64 --start-iter 2 | tee "$work/run.log"
grep -q "test accuracy" "$work/run.log" || { echo "pip_venv: powersgd-run -n 2 -- train-fashion-mnist printed no accuracy"; exit 1; }
# The DDP example under the venv's powersgd-run, started as a pip user writes it: the venv's python by its
# path (a link to the system's interpreter, which finds the venv, and so powersgd, only through that link).
OMP_NUM_THREADS=1 timeout 300 "$bin/powersgd-run" -n 2 --timeout 240 -- "$bin/python" "$work/run/torch_ddp.py" \
  --epochs 1 --train-limit 1000 --data "$data" | tee "$work/ddp-run.log"
grep -q "accuracy" "$work/ddp-run.log" || { echo "pip_venv: torch_ddp.py under powersgd-run printed no accuracy"; exit 1; }
# powersgd-halve finds powersgd-run and train-fashion-mnist beside itself.
timeout 300 "$bin/powersgd-halve" --workers 2 --epochs 1 --start-rank 2 --tolerance 100 --timeout 120 -- --data "$data" \
  --train-limit 512 --test-limit 128 --batch 64 --start-iter 2 | tee "$work/halve.log"
echo "pip_venv: powersgd-run, powersgd-bench, powersgd-halve and train-fashion-mnist ran from $bin"
