#!/usr/bin/env bash
# Set up, lint, and run the tests. Default: the fast suite (unit and single-process tests, about 3 minutes).
# --full: the whole suite, as CI runs it (also the real multi-rank gloo jobs, Prometheus, Chromium, the
# installs and the docs build; about 25 minutes on 2 cores). Other arguments go to pytest, in both of its
# sessions (below).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "test: ruff"
.venv/bin/ruff check stragglerwatch tests examples benchmarks dashboard docs
echo "test: pytest"
# the suite starts a few hundred interpreters (ranks, commands, examples): let them cache the package's
# bytecode (__pycache__ is ignored by git) instead of compiling it anew in each
unset PYTHONDONTWRITEBYTECODE
# Two sessions at once: the test files no wall-clock timing decides (tests/conftest.py's BESIDE: installs,
# the docs, in-memory analyses) at the lowest CPU priority, on the CPU time the multi-rank jobs of the
# other session leave idle (about half the machine, on average), without taking it from them. Exit 5
# (nothing selected, e.g. a -k that matches only one part) is no failure.
beside_log=$(mktemp)
beside_tmp=$(mktemp -d)
nice -n 19 .venv/bin/python -m pytest "$@" --part beside -p no:cacheprovider --basetemp "$beside_tmp/t" \
  >"$beside_log" 2>&1 &
beside=$!
main_status=0 beside_status=0
.venv/bin/python -m pytest "$@" --part main || main_status=$?
wait "$beside" || beside_status=$?
echo "test: the session beside (its tests at low priority):"
cat "$beside_log"
rm -f "$beside_log"
if [ "$beside_status" = 0 ] || [ "$beside_status" = 5 ]; then
  rm -rf "$beside_tmp"
else
  echo "test: the failed tests' files beside are kept in $beside_tmp"
fi
for status in "$main_status" "$beside_status"; do
  if [ "$status" != 0 ] && [ "$status" != 5 ]; then
    exit "$status"
  fi
done
if [ "$main_status" = 5 ] && [ "$beside_status" = 5 ]; then
  exit 5
fi
