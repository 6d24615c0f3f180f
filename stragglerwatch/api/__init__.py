"""The Python entry point of the analysis (:func:`analyze`), shared by the command line, the dashboard's
examples and user code; ``reports.py`` holds it."""

from __future__ import annotations

from stragglerwatch.api.reports import (
    ENGINES,
    FINDINGS,
    SETTINGS,
    AnalysisReport,
    analyze,
    as_report,
    detect_config,
)

__all__ = ["ENGINES", "FINDINGS", "SETTINGS", "AnalysisReport", "analyze", "as_report", "detect_config"]
