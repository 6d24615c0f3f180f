"""The live Dash dashboard: ``create_app(source)`` over a run dir or a Prometheus source."""

from stragglerwatch.presentation.dashboard.app import create_app
from stragglerwatch.presentation.dashboard.sources import PrometheusSource, RunDirSource, Snapshot

__all__ = ["PrometheusSource", "RunDirSource", "Snapshot", "create_app"]
