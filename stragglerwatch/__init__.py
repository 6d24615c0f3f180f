"""stragglerwatch: find the slow and the stuck ranks of PyTorch DDP training jobs.

Public API: :func:`attach` (returns a :class:`Watch`), :class:`Config` (every setting of
attach, documented field by field), :func:`analyze` (a run dir's typed report, with ``to_text()``,
``to_html()`` and ``to_dict()``: what ``stragglerwatch analyze`` prints), :func:`load_run`,
:func:`load_context` (the ranks' host and GPU context samples), :class:`RunDirError`, the errors a
mistaken call raises (:class:`ConfigError`, :class:`AttachError`), ``__version__``.
Everything else is internal. Runtime messages go to the ``stragglerwatch`` logger. Importing the
package does not import torch; ``attach`` does (extra ``train``: ``pip install "stragglerwatch[train]"``).
"""

from __future__ import annotations

from stragglerwatch import _compat
from stragglerwatch._version import __version__
from stragglerwatch.record.context import load_context
from stragglerwatch.record.steplog import RunDirError, RunDirWarning, load_run
from stragglerwatch.runtime.config import Config, ConfigError
from stragglerwatch.runtime.identity import AttachError

_compat.install()  # the import paths of 0.1 keep working for one release, with a warning


def __getattr__(name: str) -> object:
    """``attach`` and ``Watch`` need torch: imported on first use, so that analysis, the dashboard
    and the command line run where torch is not installed (there, ImportError with one line naming
    the extra that installs it)."""
    if name == "analyze":  # the analysis modules, on first use
        from stragglerwatch.api import analyze

        return analyze
    if name in ("attach", "Watch"):
        from stragglerwatch._extras import require

        require(f"stragglerwatch.{name}", "torch")
        from stragglerwatch.runtime import watch

        return getattr(watch, name)
    raise AttributeError(f"module 'stragglerwatch' has no attribute {name!r}")


__all__ = [
    "AttachError",
    "Config",
    "ConfigError",
    "RunDirError",
    "RunDirWarning",
    "Watch",
    "__version__",
    "analyze",
    "attach",
    "load_context",
    "load_run",
]
