#!/usr/bin/env bash
# Set up, lint, and run the whole test suite (unit tests and real multi-process gloo DDP tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "test: ruff"
.venv/bin/ruff check stragglerwatch tests examples benchmarks dashboard
echo "test: pytest"
.venv/bin/python -m pytest "$@"
