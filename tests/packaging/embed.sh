#!/usr/bin/env bash
# packaging suite: what an embedder does with powersgd (docs/install.md), on this build installed
# with `meson install --destdir` into a temporary root (so the packages must be relocatable).
#   embed.sh MODE SOURCE_DIR BUILD_DIR
# MODE:
#   cmake       tests/packaging/cmake-consumer (find_package(powersgd CONFIG), no C++ standard of its own)
#               configured, built and run; its libpowersgd must be the installed one.
#   pkg-config  the same program built with g++ -std=c++20 and `pkg-config --cflags --libs powersgd` and run;
#               `pkg-config --variable=cxx_std powersgd` says c++20.
#   cxx17       the same with -std=c++17 must fail, its first error being the headers' "need C++20".
#   python      the installed Python package (PYTHONPATH = its site directory under the root) loads the
#               installed library in libdir and reports its version; the site directory, without the root, is on
#               /usr/bin/python3's sys.path when the prefix is /usr or /usr/local.
#   subproject  a Meson project with powersgd as a subproject configures with neither the CUDA module nor
#               the Python package nor tools, examples and tests (nothing asked for).
# Exit 77 (skipped) when the tool the mode needs (cmake, pkg-config, g++) is missing.
set -euo pipefail
mode=$1
source_dir=$(cd "$2" && pwd)
build_dir=$(cd "$3" && pwd)
here=$source_dir/tests/packaging
need() { command -v "$1" >/dev/null || { echo "embed: $1 is missing: skipped"; exit 77; }; }
fail() { echo "embed $mode: $*"; exit 1; }
unset LD_LIBRARY_PATH PYTHONPATH PKG_CONFIG_PATH CMAKE_PREFIX_PATH
work=$(mktemp -d "${TMPDIR:-/tmp}/powersgd-embed.XXXXXX")
trap 'rm -rf "$work"' EXIT
export RANK=0 WORLD_SIZE=1

option() {  # the build's value of a Meson option
  meson introspect --buildoptions "$build_dir" |
    /usr/bin/python3 -c 'import json, sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"] == sys.argv[1]))' "$1"
}
install_root() {  # installs the build under $work/root; sets prefix, root (= $work/root$prefix), libdir
  meson install -C "$build_dir" --no-rebuild --destdir "$work/root" >"$work/install.log" 2>&1 ||
    { cat "$work/install.log"; fail "meson install failed"; }
  prefix=$(option prefix)
  libdir=$(option libdir)
  case $libdir in /*) libdir=${libdir#"$prefix"/} ;; esac
  root=$work/root$prefix
}
check_linked() {  # the program's libpowersgd is the one under the root (a static build: linked in)
  local resolved
  [ "$(option default_library)" != static ] || return 0
  resolved=$(ldd "$1" | awk '/libpowersgd/ {print $3}')
  case $resolved in "$work/root/"*) ;; *) fail "$1 resolves libpowersgd to '$resolved', not under $work/root" ;; esac
}

case $mode in
  cmake)
    need cmake
    install_root
    cmake -S "$here/cmake-consumer" -B "$work/cmake" -DCMAKE_PREFIX_PATH="$root" >"$work/cmake.log" 2>&1 ||
      { cat "$work/cmake.log"; fail "cmake configure failed"; }
    cmake --build "$work/cmake" >"$work/build.log" 2>&1 || { cat "$work/build.log"; fail "cmake build failed"; }
    grep -q "^powersgd_DIR:PATH=$root/" "$work/cmake/CMakeCache.txt" || fail "find_package did not take $root"
    check_linked "$work/cmake/consumer"
    "$work/cmake/consumer"
    ;;
  pkg-config | cxx17)
    need pkg-config
    need g++
    install_root
    # The installed .pc names the prefix it was configured for; the root's copy of it is elsewhere.
    export PKG_CONFIG_PATH=$root/$libdir/pkgconfig
    [ "$(pkg-config --variable=cxx_std powersgd)" = c++20 ] || fail "powersgd.pc: cxx_std is not c++20"
    pc_args=(--define-variable=prefix="$root")
    [ "$(option default_library)" != static ] || pc_args+=(--static)  # libpowersgd.a: its dependencies too
    flags=$(pkg-config "${pc_args[@]}" --cflags --libs powersgd)
    if [ "$mode" = pkg-config ]; then
      # shellcheck disable=SC2086
      g++ -std=c++20 -o "$work/consumer" "$here/cmake-consumer/main.cpp" $flags -Wl,-rpath,"$root/$libdir" ||
        fail "g++ -std=c++20 failed"
      check_linked "$work/consumer"
      "$work/consumer"
    else
      # shellcheck disable=SC2086
      if g++ -std=c++17 -c -o "$work/consumer.o" "$here/cmake-consumer/main.cpp" $flags 2>"$work/cxx17.log"; then
        fail "g++ -std=c++17 compiled the C++ API"
      fi
      first=$(grep -m1 "error" "$work/cxx17.log")
      echo "embed: -std=c++17 stops with: $first"
      case $first in *"need C++20"*) ;; *) cat "$work/cxx17.log"; fail "the first error does not say C++20 is needed" ;; esac
    fi
    ;;
  python)
    install_root
    package=$(find "$work/root" -name _library.py -path '*/powersgd/*')
    [ "$(echo "$package" | wc -l)" = 1 ] || fail "expected one installed powersgd/_library.py, found: $package"
    site=$(dirname "$(dirname "$package")")
    installed_site=${site#"$work/root"}
    cd "$work"
    PYTHONPATH=$site /usr/bin/python3 - "$site" "$root/$libdir" <<'PY'
import os, sys
import powersgd
import powersgd.torch  # noqa: F401
from powersgd import _capi
site, libdir = sys.argv[1:3]
loaded = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libpowersgd" in line})
if not powersgd.__file__.startswith(site + os.sep) or len(loaded) != 1 or os.path.dirname(loaded[0]) != libdir:
    sys.exit("embed python: powersgd from %s loaded %s (expected the package under %s, the library in %s)"
             % (powersgd.__file__, loaded, site, libdir))
if powersgd.__version__ != _capi.lib.psgd_version().decode():
    sys.exit("embed python: __version__ %s, psgd_version() %s" % (powersgd.__version__, _capi.lib.psgd_version()))
print("embed python: powersgd %s from %s, library %s" % (powersgd.__version__, powersgd.__file__, loaded[0]))
PY
    case $prefix in
      /usr | /usr/local)
        /usr/bin/python3 -c 'import os, sys; sys.exit(0 if os.path.normpath(sys.argv[1]) in map(os.path.normpath, sys.path) else 1)' \
          "$installed_site" || fail "$installed_site is not on /usr/bin/python3's sys.path"
        echo "embed python: $installed_site is on /usr/bin/python3's sys.path" ;;
    esac
    ;;
  subproject)
    mkdir -p "$work/super/subprojects"
    ln -s "$source_dir" "$work/super/subprojects/powersgd"
    cat >"$work/super/meson.build" <<'MESON'
project('super', 'cpp', default_options : ['cpp_std=c++20'])
executable('consumer', 'main.cpp', dependencies : dependency('powersgd'), install : true)
MESON
    cp "$here/cmake-consumer/main.cpp" "$work/super/"
    meson setup "$work/super/build" "$work/super" >"$work/setup.log" 2>&1 || { cat "$work/setup.log"; fail "meson setup failed"; }
    meson introspect --targets "$work/super/build" >"$work/targets.json"
    meson introspect --installed "$work/super/build" >"$work/installed.json"
    /usr/bin/python3 - "$work/targets.json" "$work/installed.json" <<'PY'
import json, sys
targets = {t["name"] for t in json.load(open(sys.argv[1]))}
installed = json.load(open(sys.argv[2])).values()
unwanted = sorted(targets & {"powersgd-cuda", "powersgd-run", "powersgd-bench", "train-fashion-mnist", "c_demo"})
python_files = sorted(p for p in installed if "/powersgd/" in p and p.endswith(".py"))
if "powersgd" not in targets or unwanted or python_files:
    sys.exit("embed subproject: targets %s; unwanted %s; Python files installed %s" % (sorted(targets), unwanted, python_files))
print("embed subproject: the library alone (%d targets), no CUDA module, no Python package" % len(targets))
PY
    ;;
  *) fail "unknown mode (cmake, pkg-config, cxx17, python, subproject)" ;;
esac
