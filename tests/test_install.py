"""An analysis host's install: ``pip install stragglerwatch`` (no extras) into a fresh venv brings no
torch, dash, plotly or ray, and the analysis commands run there; what needs an extra says which, in
one line. The package is built from a copy of the checkout (a real, non-editable install); pip
fetches the base dependencies from PyPI or its cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTRAS_ONLY = ("torch", "dash", "plotly", "ray", "werkzeug", "flask")
OFFLINE = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
           "No matching distribution found", "Could not find a version that satisfies")  # fmt: skip


def _env() -> dict[str, str]:
    """The caller's environment without what would leak the checkout or the test venv into the new one."""
    # PYTHONDONTWRITEBYTECODE too: the venv is installed without bytecode, each module compiled when first imported
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PIP_USER", "PYTHONDONTWRITEBYTECODE"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("STRAGGLERWATCH_")}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONNOUSERSITE": "1"}


def _run(cmd: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``cmd`` in the fresh venv; ``timeout`` bounds a hang (these tests run at the lowest CPU priority
    beside the multi-rank jobs: ``conftest.BESIDE``), it is no speed goal."""
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _source_copy(dest: Path) -> Path:
    """What building the package reads, copied out of the checkout: the build writes into its tree."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "stragglerwatch", dest / "stragglerwatch", ignore=ignore)
    return dest


def fresh_venv(tmp_path: Path) -> tuple[str, str, Path]:
    """A clean venv (no system site packages) under ``tmp_path``: its python, its stragglerwatch
    command, and a working folder outside the checkout (nothing can be imported from it by accident)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=_env(), timeout=120)
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    work = tmp_path / "work"
    work.mkdir()
    return str(bindir / "python"), str(bindir / "stragglerwatch"), work


@pytest.mark.install
def test_analysis_host_install_has_no_torch_dash_plotly(tmp_path: Path) -> None:
    src = _source_copy(tmp_path / "src")
    python, cli, work = fresh_venv(tmp_path)
    venv = tmp_path / "venv"

    # no bytecode compiled at install (the imports compile what they use): most of the install's time otherwise
    pip = _run([python, "-m", "pip", "install", "-q", "--no-compile", str(src)], work, timeout=300)
    if pip.returncode != 0 and any(s in pip.stdout + pip.stderr for s in OFFLINE):
        pytest.skip(f"cannot fetch the base dependencies (no PyPI, empty pip cache?): {pip.stderr.strip()[-500:]}")
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-3000:]

    # what is installed: the package (not the checkout's editable one) and its base dependencies only
    probe = _run([python, "-c", "import importlib.metadata as m, json, stragglerwatch; print(json.dumps("
                  "[stragglerwatch.__file__, sorted(d.metadata['Name'].lower() for d in m.distributions())]))"],
                 work)  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    location, names = json.loads(probe.stdout)
    assert Path(location).is_relative_to(venv), location
    assert "stragglerwatch" in names and {"numpy", "pandas", "pyarrow"} <= set(names), names
    assert not set(EXTRAS_ONLY) & set(names), f"an analysis-only install pulled {set(EXTRAS_ONLY) & set(names)}"

    # the analysis commands work there
    sim = _run([cli, "simulate", "run", "--ranks", "8", "--steps", "120", "--straggler", "3:1.3:40"], work)
    assert sim.returncode == 0, sim.stderr[-3000:]
    text = _run([cli, "analyze", "run"], work)
    assert text.returncode == 0, text.stderr[-3000:]
    assert "1 straggler:" in text.stdout and "rank 3 is" in text.stdout, text.stdout
    js = _run([cli, "analyze", "run", "--format", "json", "--out", "r.json"], work)
    assert js.returncode == 0, js.stderr[-3000:]
    assert [s["rank"] for s in json.loads((work / "r.json").read_text())["stragglers"]] == [3]
    assert _run([cli, "summary", "run"], work).returncode == 0
    assert _run([cli, "prometheus-config", "run"], work).returncode == 0

    # what needs an extra says which, in one line
    attach = _run([python, "-c", "import stragglerwatch; stragglerwatch.attach"], work)
    assert attach.returncode != 0
    assert attach.stderr.strip().splitlines()[-1] == (
        'ImportError: stragglerwatch.attach needs torch, which is not installed: pip install "stragglerwatch[train]"'
    ), attach.stderr
    dash = _run([cli, "dashboard", "run"], work)
    assert (dash.returncode, dash.stdout) == (2, ""), dash.stdout + dash.stderr
    assert dash.stderr == (
        "stragglerwatch: error: stragglerwatch dashboard needs dash and plotly, which are not installed: "
        'pip install "stragglerwatch[dashboard]"\n'
    )
    html = _run([cli, "analyze", "run", "--format", "html"], work)
    assert (html.returncode, html.stdout) == (2, ""), html.stdout + html.stderr
    assert len(html.stderr.splitlines()) == 1 and "Traceback" not in html.stderr, html.stderr
    assert 'needs plotly, which is not installed: pip install "stragglerwatch[dashboard]"' in html.stderr
    assert not (work / "run" / "report.html").exists()
