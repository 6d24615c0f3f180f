"""The ``stragglerwatch`` command (``commands``), the demo (``demo``, ``demo_job``: the demo's torchrun
job) and the dashboard command (``dashboard``). The top of the import graph: it may use every other
subpackage, and none uses it.

Nothing is imported here eagerly: the demo's training job (``demo_job``) runs in every rank of its job
and needs none of the command's analysis and drawing. ``stragglerwatch.cli`` was a module before 0.2;
its names still resolve here, with a deprecation warning (see ``stragglerwatch._compat``).
"""

from __future__ import annotations

from typing import Any

from stragglerwatch._compat import forwarder

_old_names = forwarder(__name__, ("stragglerwatch.cli.commands",))


def __getattr__(name: str) -> Any:
    if name == "main":  # the console script's entry point, stragglerwatch.cli:main
        from stragglerwatch.cli.commands import main

        return main
    return _old_names(name)


__all__ = ["main"]
