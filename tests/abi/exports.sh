#!/bin/sh
# abi-exports: libpowersgd.so exports the public API and nothing else (docs/abi.md, src/libpowersgd.map).
#   exports.sh LIBPOWERSGD POWERSGD_H
# Fails, listing them, on exports outside the public API's patterns (a Boost or libstdc++ instantiation, a
# private class, a psgd_ name powersgd.h does not declare), and on public symbols that are missing (a
# function powersgd.h declares; the Reducer, the communicator's factory; the typeinfo of every
# error class, which callers catch across the library boundary).
set -eu
lib=$1 header=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

nm -D --defined-only "$lib" | awk '{print $3}' | c++filt | sort -u > "$tmp/exports"
# Every psgd_ function the header names (declared PSGD_API, or inline like psgd_config_default, whose 0.1
# symbol the library keeps); the declared ones: every function of its code, its comments taken out by the C
# compiler's preprocessor (macros unexpanded), whether marked PSGD_API or not (one without the marker, where
# the header's visibility pragma did not reach it, was not exported and not missed here).
grep -oE '\bpsgd_[a-z0-9_]+\(' "$header" | tr -d '(' | sort -u > "$tmp/named"
# shellcheck disable=SC2086  # CC: a command with its arguments (ccache gcc)
${CC:-cc} -fpreprocessed -dD -E -P -x c "$header" | grep -oE '\bpsgd_[a-z0-9_]+\(' | tr -d '(' | sort -u \
  > "$tmp/declared"
[ -s "$tmp/declared" ] || { echo "exports.sh: no psgd_ function found in $header" >&2; exit 1; }

errors='(Error|InvalidArgumentError|IoError|TimeoutError|MismatchError|NonFiniteError|UnsupportedError'
errors="$errors|InternalError|PeerError)"
abi='(\[abi:[a-z0-9]+\])?'  # the tag of functions returning std::string
public="^powersgd::(size_of|to_string|rank_reason_name)\\(\
|^powersgd::(CommOptions|Work|Communicator|Config|Stats|ReduceHandle)::[~a-zA-Z_]+$abi\\(\
|^powersgd::Reducer::(~?Reducer|[a-z_]+)$abi\\(\
|^powersgd::OuterOptimizer::(~?OuterOptimizer|[a-z_]+)$abi\\(\
|^powersgd::OuterConfig::validate\\(\
|^powersgd::$errors::~?[a-zA-Z_]+$abi\\(\
|^(typeinfo|typeinfo name|vtable) for powersgd::(Communicator|$errors)\$"
grep -E '^psgd_' "$tmp/exports" | grep -vxF -f "$tmp/named" > "$tmp/bad_c" || true
grep -vE '^psgd_' "$tmp/exports" | grep -vE "$public" > "$tmp/bad_cpp" || true
grep -vxF -f "$tmp/exports" "$tmp/declared" > "$tmp/missing" || true
for required in 'powersgd::Reducer::Reducer(powersgd::Communicator&, powersgd::Config const&)' \
                'powersgd::Communicator::create(powersgd::CommOptions const&)' \
                'powersgd::OuterConfig::validate() const' \
                'psgd_config_default'; do
  grep -qxF "$required" "$tmp/exports" || echo "$required" >> "$tmp/missing"
done
for class in Error InvalidArgumentError IoError TimeoutError MismatchError NonFiniteError UnsupportedError \
             InternalError PeerError; do
  grep -qxF "typeinfo for powersgd::$class" "$tmp/exports" || echo "typeinfo for powersgd::$class" >> "$tmp/missing"
done

status=0
echo "exports.sh: $(wc -l < "$tmp/exports") exported symbols in $lib"
if [ -s "$tmp/bad_c" ]; then
  echo "exports.sh: psgd_ symbols that $header does not declare:"; sed 's/^/  /' "$tmp/bad_c"; status=1
fi
if [ -s "$tmp/bad_cpp" ]; then
  echo "exports.sh: $(wc -l < "$tmp/bad_cpp") symbols outside the public API (src/libpowersgd.map):"
  sed 's/^/  /' "$tmp/bad_cpp"; status=1
fi
if [ -s "$tmp/missing" ]; then
  echo "exports.sh: public symbols not exported:"; sed 's/^/  /' "$tmp/missing"; status=1
fi
[ $status -ne 0 ] || echo "exports.sh: only the public API is exported"
exit $status
