#!/bin/sh
# abi-baseline: libpowersgd.so against the ABI of the last release, stored in tests/abi/baseline (docs/abi.md,
# "The C++ API: a new soname for each incompatible change"). abigail-tools (abidw, abidiff) read the DWARF.
#   abi_check.sh check LIBPOWERSGD HEADERS_DIR BASELINE.abi REVIEWED SUPPRESSIONS
#   abi_check.sh write LIBPOWERSGD HEADERS_DIR BASELINE.abi SUPPRESSIONS     (at a release: the new baseline)
# check: while the library's soname is the baseline's, abidiff's report of what changed since the baseline
# (removed or changed symbols, and layout changes of the types reachable from them: the public C structs and
# C++ classes; added symbols are compatible and not reported) must be exactly REVIEWED, the reviewed report
# (lines starting with '#' there give the reasons and are not compared): a change nobody reviewed fails, with
# the report. A new soname passes (the baseline describes the previous one: write a new one at the release).
# Exit 77 (skipped) without abidiff, for a library without debug information, or on another architecture
# than the baseline's.
set -eu
mode=$1 lib=$2 headers=$3 baseline=$4

if ! command -v abidiff >/dev/null 2>&1 || ! command -v abidw >/dev/null 2>&1; then
  echo "abi_check: abidiff/abidw not found (Debian: apt-get install abigail-tools): skipped"
  exit 77
fi
if ! readelf -S "$lib" | grep -q '\.debug_info'; then
  echo "abi_check: $lib has no debug information (build with -Dbuildtype=debugoptimized or debug): skipped"
  exit 77
fi

# The ABI of a library as abixml: its exported interfaces, the types of the public headers (std:: and the
# like dropped by the suppressions), no paths or source locations (stable under edits of comments, no
# machine's directories). check writes one of the built library the same way and compares the two files:
# abidiff of abixml against abixml treats both sides alike (abixml against the binary reported no change of
# Config's size from 0.1 to 0.2).
write_abi() {  # library, headers, output, suppressions
  abidw --headers-dir "$2" --drop-private-types --exported-interfaces-only --suppressions "$4" --no-corpus-path \
    --no-comp-dir-path --no-show-locs --no-elf-needed --type-id-style hash --drop-undefined-syms --out-file "$3" "$1"
}

if [ "$mode" = write ]; then
  write_abi "$lib" "$headers" "$baseline" "$5"
  echo "abi_check: wrote $baseline ($(wc -c < "$baseline") bytes) from $lib"
  exit 0
fi

reviewed=$5 suppressions=$6
machine=$(readelf -h "$lib" | sed -n 's/^ *Machine: *//p')
case "$machine" in
  *X86-64*) ;;
  *) echo "abi_check: the baseline is x86-64's, $lib is for $machine: skipped"; exit 77 ;;
esac
soname=$(readelf -d "$lib" | sed -n 's/.*Library soname: \[\(.*\)\].*/\1/p')
baseline_soname=$(sed -n "s/^<abi-corpus .*soname='\([^']*\)'.*/\1/p" "$baseline")
if [ "$soname" != "$baseline_soname" ]; then
  echo "abi_check: $lib is $soname, the baseline $baseline is $baseline_soname: a new soname may change"
  echo "anything; write its baseline at the release (docs/abi.md). Not compared."
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
write_abi "$lib" "$headers" "$tmp/built.abi" "$suppressions"
abidiff --no-show-locs --no-added-syms "$baseline" "$tmp/built.abi" > "$tmp/report" 2>&1 || status=$?
# abidiff's status is a bit field: 1 an error, 2 a usage error; 4 a change, 8 an incompatible one (the report).
if [ $((status & 3)) -ne 0 ]; then
  echo "abi_check: abidiff failed (status $status):"
  cat "$tmp/report"
  exit 1
fi
# Compared: the report's details, without its summary lines (their counts include the added symbols, which
# are filtered out) and blank lines; the reviewed report without its '#' lines.
grep -v -e 'changes summary:' -e '^ *$' "$tmp/report" > "$tmp/changes" || true
grep -v -e '^#' -e '^ *$' "$reviewed" > "$tmp/reviewed" || true
if ! diff -u "$tmp/reviewed" "$tmp/changes" > "$tmp/difference"; then
  echo "abi_check: the ABI of $lib ($soname) changed since $baseline in a way nobody reviewed."
  echo "abidiff's report (status $status):"
  sed 's/^/  /' "$tmp/report"
  echo "against the reviewed report $reviewed:"
  sed 's/^/  /' "$tmp/difference"
  echo "A compatible change (a field appended to a struct that starts with struct_size, by the rule of"
  echo "powersgd.h) is recorded in the reviewed report with its reason; an incompatible one (a C++ class's"
  echo "layout, a removed or changed symbol) needs a new soname (src/meson.build) or must be undone. docs/abi.md."
  exit 1
fi
if [ -s "$tmp/changes" ]; then
  echo "abi_check: $lib ($soname) against $baseline: only the reviewed changes ($reviewed)"
else
  echo "abi_check: $lib ($soname) against $baseline: no change (added symbols are not compared)"
fi
