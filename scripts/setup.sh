#!/usr/bin/env bash
# Set up .venv with stragglerwatch (editable) and its test tools. Safe to run again.
# torch is installed first, pinned to the 2.13.0 CPU build, when the venv has none:
# an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "setup: Python >= 3.10 needed ($PY)" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip_install() { .venv/bin/python -m pip install --disable-pip-version-check -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (CPU build)"
  pip_install "torch==2.13.0"
fi
echo "setup: installing stragglerwatch and its dev tools"
pip_install -e ".[dev]"
.venv/bin/python -c 'import torch, stragglerwatch; print(f"setup: ok (stragglerwatch {stragglerwatch.__version__}, torch {torch.__version__})")'
