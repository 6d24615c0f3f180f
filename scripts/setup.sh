#!/usr/bin/env bash
# Set up .venv with stragglerwatch (editable), all its extras and its test tools. Safe to run again.
# torch is installed first, pinned to the 2.13.0 CPU build, when the venv has none:
# an unpinned torch (the extra "train" asks for torch>=2.1) would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "setup: Python >= 3.10 needed ($PY)" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip_install() { .venv/bin/python -m pip install --disable-pip-version-check -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
# Debian packages the tests drive for real: Prometheus (server and promtool) for the exporter,
# Chromium and its driver for the dashboard. Installed as root on Debian/Ubuntu; elsewhere those
# tests are skipped with a loud reason.
missing=""
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || missing="$missing prometheus"
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v chromedriver >/dev/null 2>&1 || missing="$missing chromium-driver"
# apt-get runs in the background while pip installs the Python packages (independent; a fresh CI machine
# spends minutes on each), and is waited for before the end.
apt_pid="" apt_log=""
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing$missing (apt-get, beside the Python packages)"
    apt_log=$(mktemp)
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing) >"$apt_log" 2>&1 &
    apt_pid=$!
  else
    echo "setup: WARNING:$missing not found and cannot be apt-get installed (not root on Debian):" \
         "the tests that need them will be skipped" >&2
  fi
fi
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (CPU build)"
  pip_install "torch==2.13.0"
fi
echo "setup: installing stragglerwatch with all its extras, its dev tools and the frameworks its integrations are tested with"
pip_install -e ".[all,dev,lightning,transformers]"
if [ -n "$apt_pid" ]; then
  if ! wait "$apt_pid"; then
    echo "setup: apt-get install of$missing failed:" >&2
    tail -20 "$apt_log" >&2
    exit 1
  fi
  rm -f "$apt_log"
fi
.venv/bin/python -c 'import torch, stragglerwatch; print(f"setup: ok (stragglerwatch {stragglerwatch.__version__}, torch {torch.__version__})")'
