"""The ``stragglerwatch`` command (``commands``), the demo (``demo``, ``demo_job``: the demo's torchrun
job) and the dashboard command (``dashboard``). The top of the import graph: it may use every other
subpackage, and none uses it.

``stragglerwatch.cli`` was a module before 0.2; its names still resolve here, with a deprecation
warning (see ``stragglerwatch._compat``).
"""

from stragglerwatch._compat import forwarder
from stragglerwatch.cli.commands import main

__getattr__ = forwarder(__name__, ("stragglerwatch.cli.commands",))
__all__ = ["main"]
