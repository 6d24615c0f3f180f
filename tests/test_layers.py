"""The package's shape: one subpackage per role, imports running one way, no circles, and the parts
that an analysis host runs import no torch.

The graph is read from the source (every ``import`` statement, at module level or inside a function,
``TYPE_CHECKING`` blocks included), so a lazy import against the order fails here as well."""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "stragglerwatch"

#: subpackage -> the subpackages it may import (besides itself and the private foundation modules)
ALLOWED: dict[str, set[str]] = {
    "record": set(),
    "analysis": {"record"},
    "evidence": {"analysis", "record"},
    "presentation": {"evidence", "analysis", "record"},
    "runtime": {"analysis", "record"},
    "integrations": {"runtime", "analysis", "record"},
    "cli": {"presentation", "evidence", "analysis", "runtime", "record", "integrations", "api", "<root>"},
    "<root>": {"record", "runtime", "api"},  # stragglerwatch/__init__.py: the public API
    "api": {"presentation", "evidence", "analysis", "record", "runtime"},  # analyze(): the analysis entry point
    "__main__": {"cli"},
}
#: import nothing of ours; anything may import them
FOUNDATION = {"_version", "_extras", "_compat", "_units", "_quiet", "_memory"}
#: inside ``runtime``: sub-package (or top module) -> the sub-packages it may import besides itself and
#: ``runtime.log`` (the problem reporter every part uses). ``runtime.watch`` (``attach``) alone assembles them.
RUNTIME_ALLOWED: dict[str, set[str]] = {
    "capture": set(),  # measuring the step
    "output": {"capture"},  # the step log thread, the exporter
    "actions": set(),  # the opt-in policies
    "hangs": {"capture", "actions"},  # the watchdog and what a stall leaves
    "context": set(),  # host, GPU and code samplers
    "controls": {"capture", "hangs", "output"},  # runtime control, the debug server
    "config": set(),
    "identity": set(),
    "log": set(),
    "watch": {"capture", "output", "actions", "hangs", "context", "controls", "config", "identity"},
}
NO_TORCH = ("record", "analysis", "evidence", "presentation", "api")


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that ``name`` imports, anywhere in it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out |= {f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names}
    return {m for m in out if m in known and m != name}


def graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    names = module_names(root)
    return {n: imports(n, p, set(names)) for n, p in names.items()}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "<root>"
    return parts[1]


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def against_order(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(g.items()):
        here = layer(src)
        for dst in sorted(targets):
            there = layer(dst)
            if there in FOUNDATION:
                continue
            if here in FOUNDATION:
                bad.append(f"{src} -> {dst} (a foundation module imports nothing of ours)")
            elif there != here and there not in ALLOWED.get(here, set()):
                bad.append(f"{src} -> {dst} ({here} may import only {sorted(ALLOWED.get(here, set()))})")
    return bad


def test_the_checks_find_a_circle_and_an_upward_import() -> None:
    a, b = "stragglerwatch.record.a", "stragglerwatch.analysis.b"
    g = {a: {b}, b: {a}, "stragglerwatch.analysis.c": set()}
    assert cycles(g) == [[b, a]]
    assert against_order(g) == [f"{a} -> {b} (record may import only [])"]


def test_every_module_is_in_a_subpackage_of_a_known_role() -> None:
    g = graph()
    assert len(g) > 60, "the whole package was read"
    unknown = sorted(m for m in g if layer(m) not in ALLOWED and layer(m) not in FOUNDATION)
    assert unknown == []
    flat = sorted(m for m in g if m.count(".") == 1 and layer(m) not in FOUNDATION | {"__main__"}
                  and not (PACKAGE / layer(m)).is_dir())  # fmt: skip
    assert flat == [], "modules sit in the subpackage of their role, not beside them"


def runtime_part(module: str) -> str:
    """``stragglerwatch.runtime.capture.probes`` -> ``capture``; ``stragglerwatch.runtime.watch`` -> ``watch``."""
    return module.split(".")[2]


def runtime_against_order(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(g.items()):
        if layer(src) != "runtime" or src.count(".") < 2:
            continue
        here = runtime_part(src)
        for dst in sorted(targets):
            if layer(dst) != "runtime" or dst.count(".") < 2:
                continue
            there = runtime_part(dst)
            allowed = RUNTIME_ALLOWED.get(here, set())
            if there not in (here, "log") and there not in allowed:
                bad.append(f"{src} -> {dst} (runtime.{here} may import only {sorted(allowed)})")
    return bad


def test_runtime_is_in_sub_packages_by_role_imported_one_way() -> None:
    g = graph()
    runtime = [m for m in g if layer(m) == "runtime" and m.count(".") >= 2]
    parts = {runtime_part(m) for m in runtime}
    assert parts <= set(RUNTIME_ALLOWED), sorted(parts - set(RUNTIME_ALLOWED))
    loose = sorted(m for m in runtime if m.count(".") == 2 and runtime_part(m) not in
                   {"config", "identity", "log", "watch"} and not (PACKAGE / "runtime" / runtime_part(m)).is_dir())
    assert loose == [], "a runtime module sits in the sub-package of what it does"
    assert runtime_against_order(g) == []
    assert runtime_against_order({"stragglerwatch.runtime.capture.a": {"stragglerwatch.runtime.hangs.b"}}) == [
        "stragglerwatch.runtime.capture.a -> stragglerwatch.runtime.hangs.b (runtime.capture may import only [])"]


def test_no_import_circles() -> None:
    assert cycles(graph()) == []


def test_imports_run_one_way() -> None:
    assert against_order(graph()) == []


def test_analysis_hosts_import_no_torch() -> None:
    g = graph()
    names = sorted(m for m in g if layer(m) in NO_TORCH)
    code = ("import sys; sys.modules['torch'] = None\n"  # any import of torch now fails
            "import importlib\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(len(sys.modules))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lazy = []
    for name in names:
        tree = ast.parse(module_names()[name].read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])  # fmt: skip
            lazy += [f"{name}: {m}" for m in mods if m == "torch" or m.startswith("torch.")]
    assert lazy == [], "not even inside a function"


def test_old_import_paths_work_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"stragglerwatch\.eventlog is deprecated.*record\.steplog"):
        import stragglerwatch.eventlog as old  # noqa: F401
    from stragglerwatch.record.steplog import load_run
    from stragglerwatch.runtime.output.writer import EventLogWriter

    assert old.load_run is load_run and old.EventLogWriter is EventLogWriter, "a split module's names, both halves"
    with pytest.warns(DeprecationWarning, match=r"stragglerwatch\.analysis\.analyze_run is deprecated"):
        from stragglerwatch.analysis import analyze_run
    from stragglerwatch.analysis.report import analyze_run as new

    assert analyze_run is new
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new paths warn of nothing
        from stragglerwatch.analysis import detect  # noqa: F401
        from stragglerwatch.cli import main  # noqa: F401
    with pytest.raises(AttributeError):
        import stragglerwatch.control as control

        control.no_such_name  # noqa: B018


def test_python_m_on_an_old_path_runs_the_moved_module() -> None:
    cmd = [sys.executable, "-W", "always::DeprecationWarning", "-m", "stragglerwatch.demo_job", "--help"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--slow-rank" in proc.stdout, proc.stderr[-2000:]
    assert "stragglerwatch.demo_job is deprecated" in proc.stderr and "stragglerwatch.cli.demo_job" in proc.stderr


def test_the_files_run_beside_are_test_files() -> None:
    """``conftest.BESIDE`` names files that exist (a renamed file would silently leave it)."""
    from conftest import BESIDE

    tests = Path(__file__).resolve().parent
    assert sorted(name for name in BESIDE if not (tests / name).is_file()) == []
