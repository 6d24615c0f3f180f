"""stragglerwatch: find the slow and the stuck ranks of PyTorch DDP training jobs.

Public API: :func:`attach` (returns a :class:`Watch`), :func:`load_run`,
:class:`RunDirError`, ``__version__``. Everything else is internal.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .eventlog import RunDirError, RunDirWarning, load_run  # noqa: E402
from .watch import Watch, attach  # noqa: E402

__all__ = ["RunDirError", "RunDirWarning", "Watch", "__version__", "attach", "load_run"]
