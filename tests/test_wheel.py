"""A pip user's install: the sdist and the wheel built from a copy of the checkout pass ``twine check``;
the wheel, installed with the extras ``train`` and ``dashboard`` into a fresh venv (torch 2.13.0 first,
the CPU build, as ``scripts/setup.sh`` does), runs every command from a folder outside the checkout,
with no source tree on the path: ``demo`` (its training job ships in the package), ``analyze`` of the
demo's run, ``prometheus-config`` (the rules ship as package data), ``grafana`` (the same files as the
repository's ``grafana/``) and ``python -m stragglerwatch --version``."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import free_ports
from test_install import OFFLINE, ROOT, _env, _run, _source_copy, fresh_venv

import stragglerwatch
from stragglerwatch.presentation.grafana import files as grafana_files


def _build(src: Path, dist: Path) -> tuple[Path, Path]:
    """The sdist and the wheel of ``src`` (built with this venv's setuptools: no download)."""
    cmd = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)]
    out = subprocess.run(cmd, cwd=src, env=_env(), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (sdist,), (wheel,) = dist.glob("*.tar.gz"), dist.glob("*.whl")
    return sdist, wheel


def _check_archives(sdist: Path, wheel: Path) -> None:
    twine = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)],
                           env=_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert twine.returncode == 0, twine.stdout[-2000:] + twine.stderr[-2000:]
    version = stragglerwatch.__version__
    names = zipfile.ZipFile(wheel).namelist()
    info = f"stragglerwatch-{version}.dist-info/"
    assert all(n.startswith(("stragglerwatch/", info)) for n in names), "only the package: no tests, no examples"
    for needed in ("py.typed", "__main__.py", "cli/demo_job.py", "presentation/grafana.py", "_compat.py",
                   "presentation/data/stragglerwatch.rules.yml", "record/__init__.py", "runtime/__init__.py"):
        assert f"stragglerwatch/{needed}" in names, needed
    assert f"{info}licenses/LICENSE" in names
    meta = zipfile.ZipFile(wheel).read(f"{info}METADATA").decode()
    for line in ("License-Expression: Apache-2.0", "Author: stragglerwatch developers", "Requires-Python: >=3.10",
                 "Classifier: Typing :: Typed", "Requires-Dist: prometheus-client<1,>=0.17",
                 "Project-URL: Homepage, https://github.com/stragglerwatch/stragglerwatch"):  # fmt: skip
        assert line in meta.splitlines(), f"{line!r} not in the wheel's METADATA"
    with tarfile.open(sdist) as tar:
        members = {m.split("/", 1)[1] for m in tar.getnames() if "/" in m}
    assert {"LICENSE", "pyproject.toml", "README.md", "stragglerwatch/py.typed"} <= members
    assert not any(m.startswith(("tests/", "examples/")) for m in members)


@pytest.mark.install
def test_wheel_runs_every_command_outside_the_checkout(tmp_path: Path) -> None:
    sdist, wheel = _build(_source_copy(tmp_path / "src"), tmp_path / "dist")
    _check_archives(sdist, wheel)

    python, cli, work = fresh_venv(tmp_path)
    venv = tmp_path / "venv"
    # torch first, pinned: the extra "train" asks for torch>=2.1, which unpinned would pull a CUDA build
    for spec in ("torch==2.13.0", f"{wheel}[train,dashboard]"):  # no bytecode at install: imports compile theirs
        pip = _run([python, "-m", "pip", "install", "-q", "--no-compile", spec], work, timeout=600)
        if pip.returncode != 0 and any(s in pip.stdout + pip.stderr for s in OFFLINE):
            pytest.skip(f"cannot fetch {spec} (no PyPI, empty pip cache?): {pip.stderr.strip()[-500:]}")
        assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-3000:]
    probe = _run([python, "-c", "import stragglerwatch, sys; print(stragglerwatch.__file__); print(sys.path)"], work)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert Path(probe.stdout.splitlines()[0]).is_relative_to(venv), probe.stdout
    assert str(ROOT) not in probe.stdout, "the checkout is on the installed package's path"

    version = _run([python, "-m", "stragglerwatch", "--version"], work)
    assert (version.returncode, version.stdout) == (0, f"stragglerwatch {stragglerwatch.__version__}\n")
    assert _run([cli, "--version"], work).stdout == version.stdout

    # the demo, as short as its flags allow: 2 ranks, rank 1 20 ms a step slower from step 10
    demo = _run([cli, "demo", "--exit", "--ranks", "2", "--steps", "80", "--slow-rank", "1", "--from-step", "10",
                 "--port", str(free_ports(1)), "--run-dir", "run"], work, timeout=240)  # fmt: skip
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-3000:]
    assert "demo: dashboard http://127.0.0.1:" in demo.stdout
    assert "rank 1 is" in demo.stdout and "cause: compute" in demo.stdout, demo.stdout + demo.stderr[-2000:]
    assert "the job ended with status" not in demo.stderr, demo.stderr[-3000:]

    analyze = _run([cli, "analyze", "run", "--format", "json"], work)
    assert analyze.returncode == 0, analyze.stderr[-3000:]
    report = json.loads(analyze.stdout)
    assert report["world_size"] == 2 and report["steps"] == 80, {k: report[k] for k in ("world_size", "steps")}
    assert [s["rank"] for s in report["stragglers"]] == [1], report["stragglers"]
    assert [s["cause"] for s in report["stragglers"]] == ["compute"], report["stragglers"]

    prom = _run([cli, "prometheus-config", "run"], work)
    assert prom.returncode == 0, prom.stderr[-3000:]
    (rules,) = [line.strip()[2:].strip("'\"") for line in prom.stdout.splitlines() if ".rules.yml" in line]
    assert Path(rules).is_relative_to(venv) and "alert: StragglerRank" in Path(rules).read_text(), rules

    grafana = _run([cli, "grafana", "grafana-out"], work)
    assert grafana.returncode == 0, grafana.stderr[-3000:]
    written = {p.relative_to(work / "grafana-out").as_posix() for p in (work / "grafana-out").rglob("*") if p.is_file()}
    assert written == set(grafana_files()), written
    for rel in written:  # the repository's grafana/ is what the installed command writes
        assert (work / "grafana-out" / rel).read_text() == (ROOT / "grafana" / rel).read_text(), rel
