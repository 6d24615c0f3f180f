#!/usr/bin/env bash
# Set up, lint, and run the tests. Default: the fast suite (unit and single-process tests, about 3 minutes).
# --full: the whole suite, as CI runs it (also the real multi-rank gloo jobs, Prometheus, Chromium, the
# installs and the docs build; about 15 minutes). Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "test: ruff"
.venv/bin/ruff check stragglerwatch tests examples benchmarks dashboard docs
echo "test: pytest"
# the suite starts a few hundred interpreters (ranks, commands, examples): let them cache the package's
# bytecode (__pycache__ is ignored by git) instead of compiling it anew in each
unset PYTHONDONTWRITEBYTECODE
.venv/bin/python -m pytest "$@"
