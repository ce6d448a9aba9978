#!/bin/sh
# docs/env.md must hold exactly the table `powersgd-run --print-env` prints from
# the registry in src/common/env.cpp (so the documentation cannot drift).
#   check_env_doc.sh POWERSGD_RUN DOCS_ENV_MD
set -eu
expected=$("$1" --print-env)
actual=$(sed -n '/^| Variable |/,/^$/p' "$2" | sed '/^$/d')
if [ "$expected" != "$actual" ]; then
  echo "docs/env.md is out of date with src/common/env.cpp; regenerate its table with: powersgd-run --print-env" >&2
  printf '%s\n' "$expected" > /tmp/env-expected.$$
  printf '%s\n' "$actual" > /tmp/env-actual.$$
  diff /tmp/env-expected.$$ /tmp/env-actual.$$ >&2 || true
  rm -f /tmp/env-expected.$$ /tmp/env-actual.$$
  exit 1
fi
