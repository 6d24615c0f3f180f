"""Verdicts from records: pure functions, data in and verdicts out, shared by the command line, the
dashboard and the live path.

The steps x ranks matrix (``runmatrix``), the detection thresholds (``thresholds``), its stages
(``stages``, ``consistency``, ``intermittent``, ``detect``), why a rank is slow (``explain``,
``codeprofile``) and what to try (``advice``), hangs (``hangs``), when a policy acts (``policy``), the
report and its types (``report``, ``reportschema``), and the engines that run it: a run followed as it grows (``live``)
and Ray (``rayengine``). It reads through ``stragglerwatch.record`` only, and imports no torch.

``stragglerwatch.analysis`` was a module before 0.2; its names still resolve here, with a deprecation
warning (see ``stragglerwatch._compat``).
"""

from stragglerwatch._compat import forwarder

__getattr__ = forwarder(__name__, ("stragglerwatch.analysis.report", "stragglerwatch.evidence.combine"))
