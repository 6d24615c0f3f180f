"""Drawing verdicts: the text report (``render``, ``hangrender``, ``summary``), the HTML report
(``htmlreport``, ``figures``, ``ctxfigure``), the live dashboard (``dashboard``), and what Prometheus
and Grafana are given (``promrules``, ``grafana``; ``data/`` holds the rules file). It reads verdicts
from ``stragglerwatch.analysis`` and ``stragglerwatch.evidence``, and imports no torch.
"""
