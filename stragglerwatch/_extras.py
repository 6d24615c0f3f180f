"""Optional dependencies: which extra installs them, and one clear error where one is missing.

The base install (``pip install stragglerwatch``) is an analysis host's: ``analyze``, ``simulate``,
``summary``, ``prometheus-config``, ``load_run``. ``attach`` needs torch (extra ``train``); the
dashboard and the HTML report need plotly, the dashboard also dash (extra ``dashboard``).
"""

from __future__ import annotations

import importlib.util

# module -> the extra that installs it
EXTRA = {"torch": "train", "dash": "dashboard", "plotly": "dashboard", "ray": "ray"}


def missing(*modules: str) -> list[str]:
    """Those of ``modules`` that cannot be found, without importing any of them."""
    out: list[str] = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a finder that refuses it, or a half-imported module
            found = False
        if not found:
            out.append(name)
    return out


def message(what: str, absent: list[str]) -> str:
    """One line: ``what`` needs the ``absent`` modules, and the extra(s) that install them."""
    extras = ",".join(dict.fromkeys(EXTRA.get(name, name) for name in absent))
    names = absent[0] if len(absent) == 1 else ", ".join(absent[:-1]) + " and " + absent[-1]
    verb = "is" if len(absent) == 1 else "are"
    return f'{what} needs {names}, which {verb} not installed: pip install "stragglerwatch[{extras}]"'


def require(what: str, *modules: str) -> None:
    """Raise ImportError with :func:`message`'s line if any of ``modules`` is missing."""
    absent = missing(*modules)
    if absent:
        raise ImportError(message(what, absent), name=absent[0])
