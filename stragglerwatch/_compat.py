"""The import paths of release 0.1 (one flat package), kept working for one release.

Every module used to sit directly in ``stragglerwatch/``; they now live in the subpackage of their role
(``record``, ``runtime``, ``analysis``, ``evidence``, ``presentation``, ``cli``), and those of ``runtime`` in
its sub-packages (``runtime.capture``, ``runtime.output``, ``runtime.hangs``, ``runtime.actions``,
``runtime.context``, ``runtime.controls``). Importing an old path,
for example ``import stragglerwatch.eventlog`` or ``python -m stragglerwatch.demo_job``, still works: it
emits one :class:`DeprecationWarning` naming the new module, and gives a module that forwards every
name to where it lives now. Two old modules share their name with a new subpackage
(``stragglerwatch.analysis``, ``stragglerwatch.cli``): those packages forward the old module's names
through :func:`forwarder`. The table holds module names as strings, not imports: it adds no edge to the
package's import graph, and goes away with the next release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

PACKAGE = "stragglerwatch"
REMOVED_IN = "0.3"

#: old module (under the package) -> the modules its names live in now, the main one first
MOVED: dict[str, tuple[str, ...]] = {
    "codelog": ("record.codelog",),
    "codemetrics": ("runtime.context.codemetrics",),
    "codeprofile": ("analysis.codeprofile",),
    "codesampler": ("runtime.context.codesampler",),
    "config": ("runtime.config",),
    "consistency": ("analysis.consistency",),
    "context": ("record.context",),
    "control": ("runtime.controls.control", "runtime.controls.controlspec", "record.events",),
    "controlfile": ("runtime.controls.controlfile",),
    "coverage": ("runtime.capture.coverage",),
    "ctxfigure": ("presentation.ctxfigure",),
    "ctxmetrics": ("runtime.context.ctxmetrics",),
    "dashboard": ("presentation.dashboard",),
    "dashboard.app": ("presentation.dashboard.app",),
    "dashboard.service": ("presentation.dashboard.service",),
    "dashboard.sources": ("presentation.dashboard.sources",),
    "datamark": ("runtime.capture.datamark",),
    "debugserver": ("runtime.controls.debugserver",),
    "debugstack": ("runtime.controls.debugstack",),
    "demo": ("cli.demo", "cli.dashboard",),
    "demo_job": ("cli.demo_job",),
    "detect": ("analysis.detect", "analysis.thresholds",),
    "devices": ("runtime.capture.devices",),
    "eventlog": ("record.steplog", "runtime.output.writer",),
    "explain": ("analysis.explain",),
    "exporter": ("runtime.output.exporter",),
    "extras": ("_extras",),
    "figures": ("presentation.figures",),
    "flightrec": ("evidence.flightrec",),
    "frdumps": ("evidence.frdumps",),
    "gpuctx": ("runtime.context.gpuctx", "record.context",),
    "grafana": ("presentation.grafana",),
    "hangrender": ("presentation.hangrender",),
    "hangs": ("analysis.hangs",),
    "hangverdict": ("evidence.hangverdict",),
    "hostctx": ("runtime.context.hostctx",),
    "htmlreport": ("presentation.htmlreport",),
    "intermittent": ("analysis.intermittent",),
    "live": ("analysis.live",),
    "log": ("runtime.log",),
    "models": ("runtime.capture.models",),
    "peers": ("runtime.hangs.peers",),
    "probes": ("runtime.capture.probes",),
    "promrules": ("presentation.promrules",),
    "promsource": ("record.promsource",),
    "rayengine": ("analysis.rayengine",),
    "render": ("presentation.render",),
    "report": ("presentation.summary",),
    "reportschema": ("analysis.reportschema",),
    "runinfo": ("record.rundir", "runtime.identity",),
    "runmatrix": ("analysis.runmatrix",),
    "sampler": ("runtime.context.sampler",),
    "schema": ("record.schema",),
    "shadows": ("runtime.capture.shadows",),
    "simulate": ("record.simulate",),
    "stages": ("analysis.stages",),
    "streams": ("record.streams",),
    "taps": ("runtime.capture.taps",),
    "timing": ("runtime.capture.timing",),
    "torchlogs": ("evidence.torchlogs", "evidence.logevent",),
    "torchlogs_blocks": ("evidence.torchlogs_blocks",),
    "traces": ("evidence.traces",),
    "watch": ("runtime.watch",),
    "watchdog": ("runtime.hangs.watchdog", "record.events", "runtime.hangs.dumps", "runtime.hangs.nativestacks",
                 "runtime.hangs.shutdown",),
    "whatif": ("evidence.whatif",),
    "whatif_deps": ("evidence.whatif_deps",),
    # release 0.2's one flat ``runtime`` package, now in sub-packages by role
    "runtime.probes": ("runtime.capture.probes",),
    "runtime.taps": ("runtime.capture.taps",),
    "runtime.shadows": ("runtime.capture.shadows",),
    "runtime.datamark": ("runtime.capture.datamark",),
    "runtime.work": ("runtime.capture.work",),
    "runtime.devices": ("runtime.capture.devices",),
    "runtime.models": ("runtime.capture.models",),
    "runtime.coverage": ("runtime.capture.coverage",),
    "runtime.timing": ("runtime.capture.timing",),
    "runtime.intervals": ("runtime.capture.intervals",),
    "runtime.writer": ("runtime.output.writer",),
    "runtime.exporter": ("runtime.output.exporter",),
    "runtime.watchdog": ("runtime.hangs.watchdog",),
    "runtime.peers": ("runtime.hangs.peers",),
    "runtime.dumps": ("runtime.hangs.dumps",),
    "runtime.nativestacks": ("runtime.hangs.nativestacks",),
    "runtime.shutdown": ("runtime.hangs.shutdown",),
    "runtime.hangabort": ("runtime.actions.hangabort",),
    "runtime.stragglerpolicy": ("runtime.actions.stragglerpolicy",),
    "runtime.sampler": ("runtime.context.sampler",),
    "runtime.hostctx": ("runtime.context.hostctx",),
    "runtime.gpuctx": ("runtime.context.gpuctx",),
    "runtime.ctxmetrics": ("runtime.context.ctxmetrics",),
    "runtime.codesampler": ("runtime.context.codesampler",),
    "runtime.codemetrics": ("runtime.context.codemetrics",),
    "runtime.control": ("runtime.controls.control",),
    "runtime.controlfile": ("runtime.controls.controlfile",),
    "runtime.controlspec": ("runtime.controls.controlspec",),
    "runtime.debugserver": ("runtime.controls.debugserver",),
    "runtime.debugstack": ("runtime.controls.debugstack",),
}


def _full(name: str) -> str:
    return f"{PACKAGE}.{name}"


def warn_moved(old: str, new: Sequence[str], stacklevel: int = 3) -> None:
    where = " and ".join(new)
    warnings.warn(f"{old} is deprecated and will be removed in stragglerwatch {REMOVED_IN}: import from {where}",
                  DeprecationWarning, stacklevel=stacklevel)  # fmt: skip


def forwarder(package: str, targets: Sequence[str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that finds ``name`` in ``targets`` (module names), for a package that took
    the name of an old module: its submodules are left to the import system, any other name is looked up
    in the targets, with a deprecation warning."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is not None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        for target in targets:
            module = importlib.import_module(target)
            if hasattr(module, name):
                warn_moved(f"{package}.{name}", [f"{target}.{name}"])
                value = getattr(module, name)
                vars(sys.modules[package])[name] = value  # warned once: the next lookup finds it
                return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


class _Forward(types.ModuleType):
    """An old module: its names are those of the modules they moved to."""

    _targets: tuple[str, ...]

    def __getattr__(self, name: str) -> Any:
        for target in self._targets:
            module = importlib.import_module(target)
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r} (it moved to {self._targets[0]})")

    def __dir__(self) -> list[str]:
        return sorted({n for t in self._targets for n in dir(importlib.import_module(t))})


class _Loader(importlib.abc.Loader):
    def __init__(self, targets: tuple[str, ...]):
        self.targets = targets

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warn_moved(spec.name, self.targets, stacklevel=4)
        module = _Forward(spec.name)
        module._targets = self.targets
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        importlib.import_module(self.targets[0])

    def get_code(self, fullname: str) -> types.CodeType | None:
        """``python -m <old path>`` runs the module it moved to."""
        warn_moved(fullname, self.targets, stacklevel=2)
        spec = importlib.util.find_spec(self.targets[0])
        loader = spec.loader if spec is not None else None
        return loader.get_code(self.targets[0]) if loader is not None and hasattr(loader, "get_code") else None


class OldPaths(importlib.abc.MetaPathFinder):
    """Finds the old module paths of :data:`MOVED`; any other name is left to the other finders."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(PACKAGE + "."):
            return None
        targets = MOVED.get(fullname[len(PACKAGE) + 1:])
        if targets is None:
            return None
        full = tuple(_full(t) for t in targets)
        moved = importlib.util.find_spec(full[0])  # its file: what ``python -m`` shows as ``sys.argv[0]``
        return importlib.machinery.ModuleSpec(fullname, _Loader(full), origin=moved.origin if moved else None)


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``stragglerwatch/__init__.py`` does)."""
    if not any(isinstance(f, OldPaths) for f in sys.meta_path):
        sys.meta_path.append(OldPaths())
