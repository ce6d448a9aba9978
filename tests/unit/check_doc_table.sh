#!/bin/sh
# A table of the documentation must be exactly what a program prints from the code, so that it cannot drift
# (tests env-doc, abi-doc, checkpoint-doc).
#   check_doc_table.sh DOC COMMAND [ARGS...]
# COMMAND prints the table; its first line (the header row) finds the table in DOC, which runs from that line
# to the next blank line. Fails with the difference and the command that regenerates the table.
set -eu
doc=$1
shift
expected=$("$@")
header=$(printf '%s\n' "$expected" | head -n 1)
actual=$(HEADER="$header" awk '$0 == ENVIRON["HEADER"] { on = 1 } on && /^$/ { exit } on' "$doc")
if [ "$expected" != "$actual" ]; then
  echo "$doc is out of date with the code; regenerate its table (the one that starts with '$header') with: $*" >&2
  tmp=$(mktemp -d)
  printf '%s\n' "$expected" > "$tmp/expected"
  printf '%s\n' "$actual" > "$tmp/documented"
  diff "$tmp/expected" "$tmp/documented" >&2 || true
  rm -rf "$tmp"
  exit 1
fi
